"""The estimate held to the recipe's own run.

Each case estimates a shipped CPU config on fake tensors (:func:`lightning_mem.estimate.estimate`)
and runs the same config with the same overrides through the recipe's own CLI and ``Trainer.fit``
on real CPU tensors, under the same tracker (:func:`lightning_mem.estimate.measure_fit`). Every
phase's estimated peak is within 5 % of the run's and never under it by more than 2 % (host
bytes the same). The run's data fill every micro-batch as far as the config allows -- rows of
``max_length`` tokens; prompts of ``max_prompt_length`` tokens whose responses run to
``max_new_tokens`` -- which is the case an estimate describes. FSDP2 configs run on 2 CPU
processes (gloo), each rank against the estimate's per-rank figures, tensor- and context-parallel
configs too. A recipe subclass that keeps
more alive is estimated as itself. Each technique shows its effect in the breakdown.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_mem.estimate import estimate, measure_fit
from lightning_mem.estimate.measure import filling_rows

TINY_PARAMS = 3_059_456  # tiny-llama, fp32
TINY_VOCAB = 307
TINY_BLOCK_PARAMS = 725_504  # one LlamaDecoderLayer of tiny-llama
TINY_ROOT_PARAMS = TINY_PARAMS - 4 * TINY_BLOCK_PARAMS  # embeddings, head, final norm


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, list[str]]:
    """Overrides that point SFT and PPO configs at rows that fill every micro-batch."""
    return filling_rows(tmp_path_factory.mktemp("full_rows"))


def _held(config: str, overrides: list[str], *, world_size: int = 1, recipe: str | None = None):
    """The estimate and the run's phases (per rank); asserts that the estimate holds on every rank."""
    est = estimate(config, overrides, recipe=recipe, world_size=world_size)
    ranks = measure_fit(config, overrides, recipe=recipe, world_size=world_size, steps=2)
    for phases in ranks:
        assert [p.phase for p in phases] == [p.phase for p in est.phases]
        for e, r in zip(est.phases, phases):
            assert r.device_peak_bytes > 0
            assert e.device_peak_bytes >= 0.98 * r.device_peak_bytes, (e, r)
            assert e.device_peak_bytes <= 1.05 * r.device_peak_bytes, (e, r)
            assert abs(e.host_peak_bytes - r.host_peak_bytes) <= 0.05 * max(r.host_peak_bytes, 1), (e, r)
    return est, ranks


def _breakdown(est, phase: str = "train") -> dict[str, int]:
    return {p.phase: p for p in est.phases}[phase].device_breakdown_bytes


# -- SFT ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sft_plain(data):
    return _held("configs/sft/tiny_cpu.yaml", data["sft"])


def test_sft_plain(sft_plain):
    est, _ = sft_plain
    b = _breakdown(est)
    assert TINY_PARAMS * 4 <= b["weights"] <= TINY_PARAMS * 4 + 4096  # + the rotary buffer
    assert b["optimizer_state"] >= 2 * TINY_PARAMS * 4  # AdamW: exp_avg + exp_avg_sq (+ step scalars)
    assert b["activations"] > 0
    # Gradients are freed after each step: at the peak (in backward) only this step's are alive.
    assert b["gradients"] < TINY_PARAMS * 4


@pytest.mark.parametrize("callback", ["ActivationCheckpointing", "ActivationOffload", "OptimizerStateOffload",
                                      "OptimizerInBackward"])
def test_sft_memory_callbacks(callback, data, sft_plain):
    extra = ["--trainer.gradient_clip_val=null"] if callback == "OptimizerInBackward" else []
    est, _ = _held("configs/sft/tiny_cpu.yaml",
                   [*data["sft"], f"--trainer.callbacks+=lightning_mem.callbacks.{callback}", *extra])
    plain, b = _breakdown(sft_plain[0]), _breakdown(est)
    if callback == "ActivationCheckpointing":
        assert b["activations"] < 0.6 * plain["activations"]
    elif callback == "ActivationOffload":  # the stashed activations are on the host
        assert est.phases[0].host_peak_bytes > 0
        assert est.phases[0].device_peak_bytes < sft_plain[0].phases[0].device_peak_bytes
    elif callback == "OptimizerStateOffload":  # the state leaves the device between steps
        assert est.phases[0].host_peak_bytes >= 2 * TINY_PARAMS * 4
    else:  # each gradient is stepped and freed in backward: never all of them at once
        assert b["gradients"] < 0.5 * TINY_PARAMS * 4


def test_sft_adamw8bit(data, sft_plain):
    est, _ = _held("configs/sft/tiny_cpu_adamw8bit.yaml", data["sft"])
    assert _breakdown(est)["optimizer_state"] < 0.35 * _breakdown(sft_plain[0])["optimizer_state"]  # ~2 B/param, not 8


def test_sft_lora(data):
    before = set(Path.cwd().iterdir())
    est, _ = _held("configs/sft/tiny_cpu_lora.yaml", data["sft"])
    # The runs write their seeded random base under their own temporary folders: nothing lands here.
    assert set(Path.cwd().iterdir()) == before
    b = _breakdown(est)
    adapters = 295_936  # LoRA r=16 on every block linear
    assert (TINY_PARAMS + adapters) * 4 <= b["weights"] <= (TINY_PARAMS + adapters) * 4 + 4096
    assert 2 * adapters * 4 <= b["optimizer_state"] < 2 * adapters * 4 + 65536  # AdamW on the adapters only


def test_qlora(data, sft_plain):
    # Run: seeded random weights on disk, quantized by from_pretrained. Estimate: built from
    # config.json and quantized by the same transformers/bitsandbytes steps on fake tensors.
    est, _ = _held("configs/qlora/tiny_cpu.yaml", data["sft"])
    # bitsandbytes' cached code for nested quantization is not left as the fake run made it
    # (later real quantizations in the process would use it and pack different bytes).
    from bitsandbytes.functional import create_dynamic_map, name2qmap

    assert "dynamic" not in name2qmap or torch.equal(name2qmap["dynamic"], create_dynamic_map())
    b = _breakdown(est)
    held = _tiny_4bit_bytes()
    dense = TINY_PARAMS - 2_899_968  # parameters outside the 28 block linears: embeddings, head (307 x 256), norms
    adapters = 295_936
    assert held + (dense + adapters) * 4 <= b["weights"] <= held + (dense + adapters) * 4 + 4096
    assert b["weights"] < 0.3 * _breakdown(sft_plain[0])["weights"]
    assert 0 < b["optimizer_state"] < 0.35 * 2 * adapters * 4  # 8-bit AdamW on the adapters


def _tiny_4bit_bytes() -> int:
    from lightning_mem.quantization import QuantizationSettings, quantized_causal_lm_from_config, quantized_weight_bytes

    model = quantized_causal_lm_from_config("assets/tiny-llama", QuantizationSettings(compute_dtype="float32"))
    return quantized_weight_bytes(model)[0]


FSDP2_CASES = {
    "cpu_offload": [],
    "on_device": ["--trainer.strategy.init_args.cpu_offload=false"],
    # Mixed precision: fp32 shards and optimizer state, units gathered and computed in bf16.
    "bf16_compute": ["--trainer.strategy.init_args.param_dtype=bfloat16",
                     "--trainer.strategy.init_args.reduce_dtype=float32"],
    # Units stay gathered from their forward until their backward.
    "kept_gathered": ["--trainer.strategy.init_args.cpu_offload=false",
                      "--trainer.strategy.init_args.reshard_after_forward=false"],
}


@pytest.mark.parametrize("case", list(FSDP2_CASES))
def test_sft_fsdp2_two_ranks(case, data):
    """The tiny FSDP2 SFT config (every block checkpointed) in four settings, on 2 processes: each
    rank's peak and every category against the estimate's per-rank figures."""
    offload = case in ("cpu_offload", "bf16_compute")
    est, ranks = _held("configs/sft/tiny_cpu_fsdp2.yaml", [*data["sft"], *FSDP2_CASES[case]], world_size=2)
    assert est.world_size == 2 and len(ranks) == 2
    for (real,) in ranks:  # the same bytes, not only the same sum
        for cat, value in real.device_breakdown_bytes.items():
            assert abs(est.phases[0].device_breakdown_bytes[cat] - value) <= max(0.05 * value, 65536), (cat, est, real)
    # The sharding shows in what each rank really held at its peak.
    real = ranks[0][0].device_breakdown_bytes
    adamw = 2 * 4 * TINY_PARAMS  # exp_avg + exp_avg_sq, fp32, unsharded
    # Gathered for compute: the root unit and two blocks (the one computing, the one prefetched);
    # each parameter's rows are padded to an even split over the ranks (at most a few KB).
    gathered = 4 * (TINY_ROOT_PARAMS + 2 * TINY_BLOCK_PARAMS)
    if case == "bf16_compute":  # the gathered units are bf16; the host shards fp32
        assert real["weights"] <= gathered // 2 + 4096
        assert ranks[0][0].host_peak_bytes >= (4 + 4 + 8) * TINY_PARAMS / 2
    elif case == "kept_gathered":  # at the peak (in backward) more than two blocks are gathered
        assert real["weights"] > 4 * TINY_PARAMS / 2 + gathered
    elif offload:  # shards, their gradients and the optimizer live on the host: half of each per rank
        assert real["optimizer_state"] == 0
        assert gathered <= real["weights"] <= gathered + 4096
        assert ranks[0][0].host_peak_bytes >= (4 + 4 + 8) * TINY_PARAMS / 2
    else:  # half the optimizer state per rank; half the weights plus the gathered units
        assert adamw / 2 <= real["optimizer_state"] <= adamw / 2 + 4096
        assert 4 * TINY_PARAMS / 2 + gathered <= real["weights"] <= 4 * TINY_PARAMS / 2 + gathered + 8192


def test_sft_packed(data):
    """Packed SFT (rows of max_length holding whole examples, isolated by their position ids): the
    estimate runs the largest packed micro-batch (lightning_mem.data.packing.largest_packed_batch)."""
    est, ranks = _held("configs/sft/tiny_cpu_packed.yaml", data["sft"])
    assert "4 x 64 tokens" in est.phases[0].shape  # max_tokens_per_batch // max_length full rows
    for cat, value in ranks[0][0].device_breakdown_bytes.items():
        assert abs(_breakdown(est)[cat] - value) <= max(0.05 * value, 65536), (cat, est, ranks)


# -- tensor and context parallelism on 2 ranks -----------------------------------------------------

PARALLEL_CASES = {
    "sft_tp2": ("configs/sft/tiny_cpu_tp2.yaml", "sft"),
    "sft_cp2": ("configs/sft/tiny_cpu_cp2.yaml", "sft"),
    "grpo_cp2": ("configs/ppo/tiny_cpu_grpo_cp2.yaml", "ppo"),
}


@pytest.mark.parametrize("case", list(PARALLEL_CASES))
def test_parallel_two_ranks(case, data):
    """The tiny TP 2 (+ sequence parallel) and CP 2 (Ulysses) configs on 2 processes: every phase of
    each rank against the estimate's per-rank figures. Under CP the one-process estimate pads each
    sequence as the split does and makes the all-to-all's copies (lightning_mem/estimate/ulysses.py),
    so every category is the rank's too; under TP the peak is, not its split into categories (the
    rank peaks in another moment of the step than the divided one-process run)."""
    config, rows = PARALLEL_CASES[case]
    est, ranks = _held(config, data[rows], world_size=2)
    assert est.world_size == 2 and len(ranks) == 2
    if case == "sft_tp2":
        return
    for phases in ranks:
        for e, r in zip(est.phases, phases):
            for cat, value in r.device_breakdown_bytes.items():
                assert abs(e.device_breakdown_bytes[cat] - value) <= max(0.05 * value, 65536), (case, cat, e, r)


# -- PPO / GRPO -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ppo_gae(data):
    return _held("configs/ppo/tiny_cpu.yaml", data["ppo"])


def test_ppo_gae_separate_critic(ppo_gae):
    est, _ = ppo_gae
    phases = {p.phase: p for p in est.phases}
    assert list(phases) == ["rollout", "score", "train"]
    assert phases["rollout"].device_breakdown_bytes["kv_cache"] > 0
    assert phases["train"].device_breakdown_bytes["gradients"] > 0
    # actor + reference + critic (a backbone with a value head instead of the LM head)
    assert phases["score"].device_breakdown_bytes["weights"] >= 2.5 * TINY_PARAMS * 4


def test_grpo_lora(data):
    lora = '--model.lora={"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}'
    est, _ = _held("configs/ppo/tiny_cpu_grpo.yaml", [*data["ppo"], lora, "--data.batch_size=2"])
    train = _breakdown(est)
    # LoRA: only the adapters have optimizer state; one copy of the base weights (no reference copy).
    assert 0 < train["optimizer_state"] < 0.05 * train["weights"]
    assert train["weights"] < 2 * TINY_PARAMS * 4


def test_grpo_packed(data):
    """`model.ppo.packing`: the estimate runs the recipe's packed passes (its StepIO gets the packed
    plan through the same call) and holds against the real fit."""
    est, _ = _held("configs/ppo/tiny_cpu_grpo_packed.yaml", [*data["ppo"], "--data.batch_size=2"])
    assert [p.phase for p in est.phases] == ["rollout", "score", "train"]


def test_ppo_fsdp2_two_ranks(data):
    """PPO under FSDP2 on 2 ranks (actor, critic and reference each sharded per block; CPU offload;
    checkpointing; activation offload): every phase of each rank against the estimate."""
    est, ranks = _held("configs/ppo/tiny_cpu_fsdp2.yaml", data["ppo"], world_size=2)
    assert [p.phase for p in est.phases] == ["rollout", "score", "train"]
    for phases in ranks:
        # In the update the critic's last reduce-scatter input and root gradients wait while the
        # actor's backward runs: the gradients in flight are followed per model.
        e, r = est.phases[-1].device_breakdown_bytes, phases[-1].device_breakdown_bytes
        assert abs(e["gradients"] - r["gradients"]) <= 65536, (e, r)


# A rollout long enough for the KV cache to matter, and budgets small enough for several
# micro-batches per phase: what the fast estimate skips, the full-loop one runs.
LONG_ROLLOUT = [
    "--model.name_or_path=assets/tiny-llama",
    "--data.batch_size=32",
    "--data.max_prompt_length=8",
    "--model.generation.max_new_tokens=32",
    "--model.ppo.max_tokens_per_microbatch=128",
    "--model.ppo.logprob_max_tokens_per_microbatch=256",
]


def test_ppo_fast_loops_equal_full_loops(monkeypatch):
    """Generation's prefill + last decode step, two micro-batches per shape and two mini-batches
    give the peaks of every decode step, micro-batch, mini-batch and epoch."""
    import recipes.ppo

    losses = []
    original = recipes.ppo.PPOModule.loss
    monkeypatch.setattr(recipes.ppo.PPOModule, "loss", lambda self, mb: losses.append(len(mb)) or original(self, mb))
    fast = estimate("configs/ppo/tiny_cpu.yaml", LONG_ROLLOUT)
    fast_losses, losses[:] = len(losses), []
    full = estimate("configs/ppo/tiny_cpu.yaml", LONG_ROLLOUT, full_loops=True)
    # The measured step: 2 epochs x 2 mini-batches of 16 sequences of 40 tokens, in 128-token
    # micro-batches: five of 3 and one of 1. The fast run keeps the first mini-batch of the first
    # epoch, and of its micro-batches two of the first shape and the last one (3, against
    # 2 x 2 x 6). Before it, a warm-up step: 32 sequences of 8 prompt tokens and a 1-token
    # response, 14 to a micro-batch: two micro-batches per mini-batch, of one mini-batch (fast) or
    # of 2 epochs x 2 mini-batches (full).
    assert (fast_losses, len(losses)) == (2 + 3, 8 + 24)
    assert [p.phase for p in fast.phases] == [p.phase for p in full.phases]
    for f, r in zip(fast.phases, full.phases):
        assert abs(f.device_peak_bytes - r.device_peak_bytes) <= 0.05 * r.device_peak_bytes, (f, r)
    rollout = _breakdown(fast, "rollout")
    # The last decode step's cache: 32 sequences x (8 + 31) tokens x 4 layers x (k, v) x 4 heads x 32 x 4 B.
    assert rollout["kv_cache"] >= 32 * 39 * 4 * 2 * 4 * 32 * 4


# -- a recipe subclass is estimated as itself ------------------------------------------------------


def test_sft_subclass_is_estimated_as_itself(data, sft_plain):
    """A subclass whose training_step keeps one more fp32 [tokens, vocab] tensor alive through
    backward (tests/estimate/sft_keeps_logits.py): the estimate grows as the run does."""
    est, ranks = _held("configs/sft/tiny_cpu.yaml", data["sft"], recipe="tests.estimate.sft_keeps_logits")
    kept = 4 * 64 * TINY_VOCAB * 4  # 4 rows x 64 tokens x vocab, fp32
    grown_est = est.phases[0].device_peak_bytes - sft_plain[0].phases[0].device_peak_bytes
    grown_run = ranks[0][0].device_peak_bytes - sft_plain[1][0][0].device_peak_bytes
    assert grown_est >= kept and grown_run >= kept
    assert abs(grown_est - grown_run) <= 0.02 * sft_plain[1][0][0].device_peak_bytes


def test_ppo_subclass_is_estimated_as_itself(data, ppo_gae):
    """A PPO subclass whose loss keeps one more forward's logits alive until the optimizer step
    (tests/estimate/ppo_keeps_logits.py): the train phase grows in the estimate as in the run,
    the others do not."""
    est, ranks = _held("configs/ppo/tiny_cpu.yaml", data["ppo"], recipe="tests.estimate.ppo_keeps_logits")
    base_est, base_run = ppo_gae[0].phases, ppo_gae[1][0]
    for e, r, be, br in zip(est.phases, ranks[0], base_est, base_run):
        grown_est, grown_run = e.device_peak_bytes - be.device_peak_bytes, r.device_peak_bytes - br.device_peak_bytes
        if e.phase == "train":
            assert grown_est > 0 and grown_run > 0
        else:
            assert grown_est == 0 and abs(grown_run) <= 65536
        assert abs(grown_est - grown_run) <= 0.02 * br.device_peak_bytes, (e.phase, grown_est, grown_run)
