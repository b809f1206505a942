"""The estimate of separate placement (``configs/ppo/tiny_cpu_async.yaml``): two kinds of rank.

A training rank is the recipe's own fit without generation: its ``receive`` phase only takes the
samples, and its score and train phases are the colocated run's, up to the few sample tensors only
separate placement keeps (the behaviour log-probs, the version tags, the request sent ahead). It is
held to the recipe's real run with a real generator process. A generating rank holds its own copy
of the actor in the compute dtype: its weights and the weight sync's receive buffers are exact
byte counts; its generation is the colocated rollout's (same KV cache), and the fake-tensor figures
equal the same code's on real tensors.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from lightning_mem.estimate import estimate, measure_fit
from lightning_mem.estimate.measure import filling_rows
from lightning_mem.estimate.report import table, to_dict

CONFIG = "configs/ppo/tiny_cpu_async.yaml"
MODEL = "assets/tiny-llama"
BASE = [f"--model.name_or_path={MODEL}", "--model.async_rollout.rollout_correction=false"]


@pytest.fixture(scope="module")
def both():
    """The separate estimate and the colocated one of the same config (TIS off in both)."""
    return estimate(CONFIG, BASE), estimate(CONFIG, [*BASE, "--model.rollout_engine.placement=colocated"])


def test_the_training_rank_is_the_colocated_estimate_without_generation(both):
    separate, colocated = both
    assert [p.phase for p in separate.phases] == ["receive", "score", "train"]
    assert [p.phase for p in colocated.phases] == ["rollout", "score", "train"]
    assert colocated.generator is None
    sep, col = {p.phase: p for p in separate.phases}, {p.phase: p for p in colocated.phases}
    # Separate placement keeps a few sample tensors more: the behaviour log-probs (fp32) and version
    # tags of the 64 samples, and the next iteration's request, sent ahead (max_staleness 1): 64 x 64
    # prompt ids and mask (int64).
    rows, prompt, new = 64, 64, 6
    extra = rows * new * 4 + rows * 8 + 2 * rows * prompt * 8
    for name in ("score", "train"):
        more = sep[name].device_peak_bytes - col[name].device_peak_bytes
        assert 0 <= more <= extra + 8192, (name, more, extra)
        for cat in ("weights", "gradients", "optimizer_state", "kv_cache"):
            assert sep[name].device_breakdown_bytes[cat] == col[name].device_breakdown_bytes[cat], (name, cat)
    # No generation on a training rank: nothing of the KV cache, and the receive phase holds the
    # resting state and the samples only.
    assert sep["receive"].device_breakdown_bytes["kv_cache"] == 0
    assert sep["receive"].device_peak_bytes < col["rollout"].device_peak_bytes / 2
    # The generating rank samples what the colocated rollout samples: the same KV cache.
    gen = {p.phase: p for p in separate.generator.phases}
    assert list(gen) == ["load_weights", "generate"]
    assert gen["generate"].device_breakdown_bytes["kv_cache"] == col["rollout"].device_breakdown_bytes["kv_cache"] > 0
    assert separate.device_peak_bytes == max(p.device_peak_bytes for p in [*separate.phases, *separate.generator.phases])


def _tiny_fp32():
    from lightning_mem.models import load_causal_lm

    return load_causal_lm(MODEL, dtype="float32")


def test_the_generating_rank_holds_its_copy_and_one_message_of_the_sync_exactly(both):
    from lightning_mem.rl import rollout_link as rl
    from lightning_mem.rl.async_client import weight_messages

    separate, _ = both
    gen = {p.phase: p for p in separate.generator.phases}
    model = _tiny_fp32()
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert gen["generate"].device_breakdown_bytes["weights"] == weights  # one copy, fp32 under 32-true
    assert gen["load_weights"].device_breakdown_bytes["weights"] == weights
    # Receiving: the largest message's buffers (its names, up to 15 tensors) beside the weights.
    largest = max(sum(t.numel() * t.element_size() for t in [rl.names_tensor(names), *tensors])
                  for names, tensors in weight_messages(model, bucket_bytes=256 << 20))
    assert gen["load_weights"].device_peak_bytes == weights + largest
    # A smaller bucket: smaller messages, a lower peak.
    small = estimate(CONFIG, [*BASE, "--model.rollout_engine.sync_bucket_mb=1"])
    load = {p.phase: p for p in small.generator.phases}["load_weights"]
    largest_1mb = max(sum(t.numel() * t.element_size() for t in [rl.names_tensor(names), *tensors])
                      for names, tensors in weight_messages(model, bucket_bytes=1 << 20))
    assert load.device_peak_bytes == weights + largest_1mb < gen["load_weights"].device_peak_bytes


def test_the_generating_ranks_log_prob_pass_runs_the_generators_code_in_the_score_phases_micro_batches(monkeypatch):
    """Responses of 256 tokens: over the whole batch (a budget above it) the behaviour log-prob pass is
    the generating rank's peak; in ``model.ppo.logprob_max_tokens_per_microbatch`` micro-batches (the
    trainer's score phase's knob) that pass is run by the generator's own
    :meth:`~lightning_mem.rl.async_generator.GeneratorModel.behaviour_logprobs`, each micro-batch
    within the budget, and the peak falls to the decode's (its KV cache)."""
    from lightning_mem.rl.async_generator import GeneratorModel

    planned = []
    original = GeneratorModel.behaviour_logprobs

    def spy(self, exp):
        plan = self.plan

        def recorded(lengths, max_tokens, **kw):
            batches = plan(lengths, max_tokens, **kw)
            planned.append((max_tokens, [len(b) * max(int(lengths[i]) for i in b) for b in batches]))
            return batches

        self.plan = recorded
        try:
            return original(self, exp)
        finally:
            self.plan = plan

    monkeypatch.setattr(GeneratorModel, "behaviour_logprobs", spy)
    long = [*BASE, "--model.generation.max_new_tokens=256"]
    generate = {}
    for budget in (100_000, 2048):
        planned.clear()
        est = estimate(CONFIG, [*long, f"--model.ppo.logprob_max_tokens_per_microbatch={budget}"])
        generate[budget] = {p.phase: p for p in est.generator.phases}["generate"]
        assert planned and all(max_tokens == budget and max(sizes) <= budget for max_tokens, sizes in planned)
    assert max(len(sizes) for _, sizes in planned) >= 2  # 64 samples of 320 tokens in 2048-token micro-batches
    whole, split = generate[100_000], generate[2048]
    assert whole.device_breakdown_bytes["kv_cache"] == 0  # the log-prob pass is the peak, after the decode
    assert split.device_breakdown_bytes["kv_cache"] > 0  # now the decode is
    assert split.device_peak_bytes < whole.device_peak_bytes / 2, (split.device_peak_bytes, whole.device_peak_bytes)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_vllm_generating_rank_holds_its_reservation_beside_one_message_of_the_sync(both, device):
    """``rollout_engine.name: vllm``: the generator's copy is vLLM's reservation, made at its start and
    held for good: its weights (exact) and the rest of ``gpu_memory_utilization`` of the device (on
    the CPU, ``cpu_kv_cache_space_gb``). ``load_weights`` adds the largest message's buffers, exactly;
    ``generate`` the samples and the outbox only. The training rank does not change with the engine."""
    from lightning_mem.rl import rollout_link as rl
    from lightning_mem.rl.async_client import weight_messages

    extra, device_memory = ([], None) if device == "cpu" else (
        ["--trainer.accelerator=gpu", "--model.rollout_engine.gpu_memory_utilization=0.5"], 2 << 30)
    est = estimate(CONFIG, [*BASE, "--model.rollout_engine.name=vllm", *extra], device_memory=device_memory)
    gen = {p.phase: p for p in est.generator.phases}
    model = _tiny_fp32()
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    largest = max(sum(t.numel() * t.element_size() for t in [rl.names_tensor(names), *tensors])
                  for names, tensors in weight_messages(model, bucket_bytes=256 << 20))
    reserved = 1 << 30 if device == "cpu" else (1 << 30) - weights  # 1 GiB of KV; half of 2 GiB, less the weights
    rounded = lambda n: n if device == "cpu" else -(-n // 512) * 512  # noqa: E731 (the CUDA model's blocks)
    for phase in gen.values():
        assert phase.device_breakdown_bytes["kv_cache"] == rounded(reserved)
        assert phase.device_breakdown_bytes["weights"] >= weights
    if device == "cpu":
        assert gen["load_weights"].device_peak_bytes == weights + reserved + largest
        samples = gen["generate"].device_peak_bytes - weights - reserved
        assert 0 < samples < largest, samples  # 64 samples of 70 tokens and the outbox: well under a message
        separate, _ = both
        for ours, hf in zip(est.phases, separate.phases):  # (a few bytes move between runs: run folder names)
            assert ours.phase == hf.phase and abs(ours.device_peak_bytes - hf.device_peak_bytes) <= 1024
    else:  # vLLM's profile counts its cuBLAS workspaces inside its share: none beside it
        assert gen["generate"].device_breakdown_bytes["other"] < 1 << 20
    assert "vLLM's copy of the actor and its reservation" in " ".join(est.notes)


def test_a_remax_generating_rank_counts_the_greedy_decode_beside_the_requests_samples(monkeypatch):
    """ReMax: the generating rank's ``generate`` runs the generator's own ``sample`` with the greedy
    answers asked for, as the request asks. Against the same estimate with the greedy decode left
    out, its peak is the same decode's (the same KV cache: one decode at a time) with the request's
    samples alive beside it: higher by at least their bytes, and by less than the greedy answers'
    on top. The greedy answers travel in the samples' layout."""
    import lightning_mem.estimate.generator as generator

    sampled = generator._sample
    asked, sizes = [], {}

    def recorded(*args):
        samples = sampled(*args)
        asked.append(args[-1])
        sizes[args[-1]] = [t.numel() * t.element_size() for t in samples]
        return samples

    monkeypatch.setattr(generator, "_sample", recorded)
    remax = [*BASE, "--model.advantage_estimator=remax"]
    est = estimate(CONFIG, remax)
    monkeypatch.setattr(generator, "_sample", lambda *args: recorded(*args[:-1], False))
    without = estimate(CONFIG, remax)
    assert asked == [True, False]  # the request asked for them; the control leaves them out
    rows = 8  # ReMax samples one answer per prompt: the batch's 8 prompts
    assert len(sizes[False]) == 6 and sizes[True][6:] == [rows * 6 * 8, rows * 8]  # ids of 6 new tokens, lengths
    ours, theirs = ({p.phase: p for p in e.generator.phases}["generate"] for e in (est, without))
    assert ours.device_breakdown_bytes["kv_cache"] == theirs.device_breakdown_bytes["kv_cache"] > 0
    samples, answers = sum(sizes[False]), sum(sizes[True][6:])
    assert samples <= ours.device_peak_bytes - theirs.device_peak_bytes < samples + answers


def test_the_generating_rank_on_fake_tensors_equals_the_same_code_on_real_ones(both):
    separate, _ = both
    real = estimate(CONFIG, BASE, fake=False)
    for f, r in zip(separate.generator.phases, real.generator.phases):
        assert f.phase == r.phase
        assert abs(f.device_peak_bytes - r.device_peak_bytes) <= 0.02 * r.device_peak_bytes, (f, r)


def test_the_training_rank_holds_against_the_real_run_with_a_generator_process(tmp_path):
    """The recipe's real fit, with a real generator process, under the same tracker: every phase
    of the training rank within 5 % (and never 2 % under)."""
    data = filling_rows(tmp_path)["ppo"]
    overrides = [*data, "--model.async_rollout.rollout_correction=false", "--model.async_rollout.timeout_s=300"]
    est = estimate(CONFIG, overrides)
    (run,) = measure_fit(CONFIG, overrides, steps=2)
    assert [p.phase for p in run] == ["rollout", "score", "train"]  # the recipe's own phase names
    for e, r in zip(est.phases, run):
        assert e.device_peak_bytes >= 0.98 * r.device_peak_bytes, (e, r)
        assert e.device_peak_bytes <= 1.05 * r.device_peak_bytes, (e, r)


def test_both_roles_in_the_table_and_the_json(both):
    separate, colocated = both
    device = 2 << 30
    data = to_dict(separate, device)
    assert set(data["roles"]) == {"training", "generating"}
    assert data["roles"]["training"]["ranks"] == 1 and data["roles"]["generating"]["ranks"] == 1
    assert [p["phase"] for p in data["roles"]["generating"]["phases"]] == ["load_weights", "generate"]
    assert data["phases"] == data["roles"]["training"]["phases"]
    assert data["fits"] is True and data["roles"]["generating"]["fits"] is True
    # A colocated config's JSON has no new key.
    assert "roles" not in to_dict(colocated, device)
    text = table(separate, device)
    assert "training ranks: 1" in text and "generating ranks: 1" in text
    assert "training rank: peak" in text and "generating rank: peak" in text
    # The verdict takes each role against its device: a device that fits the generating rank but
    # not the training rank does not fit.
    between = (separate.generator.device_peak_bytes + separate.training_peak_bytes) // 2
    assert separate.generator.device_peak_bytes < separate.training_peak_bytes
    from lightning_mem.estimate.report import MARGIN_BYTES, MARGIN_FRACTION

    device = int((between + MARGIN_BYTES) / (1 - MARGIN_FRACTION)) + 1
    data = to_dict(separate, device)
    assert data["roles"]["generating"]["fits"] is True and data["roles"]["training"]["fits"] is False
    assert data["fits"] is False


def test_more_generators_than_training_ranks_is_one_line_before_any_model_loads():
    with pytest.raises(ValueError) as err:
        estimate(CONFIG, [*BASE, "--model.async_rollout.generator_devices=2"])
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("`model.async_rollout.generator_devices`=2 with 1 training rank(s)")


def test_the_command_reports_both_roles_as_json():
    out = subprocess.run(
        [sys.executable, "-m", "lightning_mem.estimate", "--config", CONFIG, *BASE, "--device-memory", "2GiB", "--json"],
        capture_output=True, text=True, check=True,
    )
    data = json.loads(out.stdout)
    assert data["roles"]["generating"]["device_peak_bytes"] > 0 and data["fits"] is True
