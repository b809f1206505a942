"""The estimate on fake tensors against the same tracker on the same step really run on CPU tensors.

Each case runs the recipe's own step twice through :func:`lightning_mem.estimate.estimate`: on
fake tensors (the estimate) and with ``fake=False`` on real CPU tensors of the tiny model; the
per-phase peaks of tracked tensor bytes must agree within 5 % (they agree exactly today), and each
technique must show its effect in the breakdown. FSDP2, which the estimate runs unsharded and
derives per rank, is compared with the same step really sharded over 2 CPU processes
(:func:`lightning_mem.estimate.measure_sharded`), rank by rank.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_mem.estimate import estimate, measure_sharded

TINY_PPO = ["--model.name_or_path=assets/tiny-llama"]
GRPO_LORA = TINY_PPO + [
    "--model.advantage_estimator=grpo",
    '--model.lora={"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}',
    "--model.grpo.group_size=4",
    "--data.batch_size=8",
]


def _both(config: str, overrides: list[str]):
    fake = estimate(config, overrides)
    real = estimate(config, overrides, fake=False)
    return fake, real


def _assert_close(fake, real) -> None:
    assert [p.phase for p in fake.phases] == [p.phase for p in real.phases]
    for f, r in zip(fake.phases, real.phases):
        assert r.device_peak_bytes > 0
        assert abs(f.device_peak_bytes - r.device_peak_bytes) <= 0.05 * r.device_peak_bytes, (f, r)
        assert abs(f.host_peak_bytes - r.host_peak_bytes) <= 0.05 * max(r.host_peak_bytes, 1), (f, r)


@pytest.fixture(scope="module")
def sft_plain():
    return _both("configs/sft/tiny_cpu.yaml", [])


def test_sft_plain(sft_plain):
    fake, real = sft_plain
    _assert_close(fake, real)
    b = fake.phases[0].device_breakdown_bytes
    params = 3_059_456  # tiny-llama, fp32
    assert params * 4 <= b["weights"] <= params * 4 + 4096  # + the rotary buffer
    assert b["optimizer_state"] >= 2 * params * 4  # AdamW: exp_avg + exp_avg_sq (+ step scalars)
    assert b["activations"] > 0


def test_sft_activation_checkpointing(sft_plain):
    overrides = ["--trainer.callbacks+=lightning_mem.callbacks.ActivationCheckpointing"]
    fake, real = _both("configs/sft/tiny_cpu.yaml", overrides)
    _assert_close(fake, real)
    plain = sft_plain[0].phases[0].device_breakdown_bytes["activations"]
    assert fake.phases[0].device_breakdown_bytes["activations"] < 0.6 * plain


def test_sft_activation_offload(sft_plain):
    overrides = ["--trainer.callbacks+=lightning_mem.callbacks.ActivationOffload"]
    fake, real = _both("configs/sft/tiny_cpu.yaml", overrides)
    _assert_close(fake, real)
    assert fake.phases[0].host_peak_bytes > 0  # the stashed activations
    plain = sft_plain[0].phases[0].device_peak_bytes
    assert fake.phases[0].device_peak_bytes < plain


def test_sft_adamw8bit(sft_plain):
    fake, real = _both("configs/sft/tiny_cpu_adamw8bit.yaml", [])
    _assert_close(fake, real)
    state = fake.phases[0].device_breakdown_bytes["optimizer_state"]
    fp32_state = sft_plain[0].phases[0].device_breakdown_bytes["optimizer_state"]
    assert state < 0.35 * fp32_state  # ~2 bytes per parameter instead of 8


def _both_writing_nothing(config: str, overrides: list[str]):
    # The real run writes its seeded random base under the estimate's temporary folder (the
    # estimate builds it from config.json on fake tensors): nothing lands in the working directory.
    before = set(Path.cwd().iterdir())
    both = _both(config, overrides)
    assert set(Path.cwd().iterdir()) == before
    return both


def test_sft_lora():
    fake, real = _both_writing_nothing("configs/sft/tiny_cpu_lora.yaml", [])
    _assert_close(fake, real)
    b = fake.phases[0].device_breakdown_bytes
    params, adapters = 3_059_456, 295_936  # tiny-llama; LoRA r=16 on every block linear
    assert (params + adapters) * 4 <= b["weights"] <= (params + adapters) * 4 + 4096
    assert 2 * adapters * 4 <= b["optimizer_state"] < 2 * adapters * 4 + 65536  # AdamW on the adapters only


def test_qlora(sft_plain):
    # Real: seeded random weights on disk, quantized by from_pretrained. Fake: built from
    # config.json and quantized by the same transformers/bitsandbytes steps on fake tensors.
    fake, real = _both_writing_nothing("configs/qlora/tiny_cpu.yaml", [])
    _assert_close(fake, real)
    # bitsandbytes' cached code for nested quantization is not left as the fake run made it
    # (later real quantizations in the process would use it and pack different bytes).
    from bitsandbytes.functional import create_dynamic_map, name2qmap

    assert "dynamic" not in name2qmap or torch.equal(name2qmap["dynamic"], create_dynamic_map())
    b = fake.phases[0].device_breakdown_bytes
    # 4-bit block linears (packed + double-quantized state), fp32 embeddings/norms/head, fp32 adapters.
    held = _tiny_4bit_bytes()
    dense = 3_059_456 - 2_899_968  # parameters outside the 28 block linears: embeddings, head (307 x 256), norms
    adapters = 295_936
    assert held + (dense + adapters) * 4 <= b["weights"] <= held + (dense + adapters) * 4 + 4096
    assert b["weights"] < 0.3 * sft_plain[0].phases[0].device_breakdown_bytes["weights"]
    assert 0 < b["optimizer_state"] < 0.35 * 2 * adapters * 4  # 8-bit AdamW on the adapters


def _tiny_4bit_bytes() -> int:
    from lightning_mem.quantization import QuantizationSettings, quantized_causal_lm_from_config, quantized_weight_bytes

    model = quantized_causal_lm_from_config("assets/tiny-llama", QuantizationSettings(compute_dtype="float32"))
    return quantized_weight_bytes(model)[0]


def test_ppo_gae_separate_critic():
    fake, real = _both("configs/ppo/tiny_cpu.yaml", TINY_PPO)
    _assert_close(fake, real)
    phases = {p.phase: p for p in fake.phases}
    assert set(phases) == {"rollout", "score", "train"}
    assert phases["rollout"].device_breakdown_bytes["kv_cache"] > 0
    assert phases["train"].device_breakdown_bytes["gradients"] > 0
    # actor + reference + critic (a backbone with a value head instead of the LM head)
    assert phases["score"].device_breakdown_bytes["weights"] >= 2.5 * 3_059_456 * 4


def test_ppo_grpo_lora():
    fake, real = _both("configs/ppo/tiny_cpu.yaml", GRPO_LORA)
    _assert_close(fake, real)
    train = {p.phase: p for p in fake.phases}["train"].device_breakdown_bytes
    # LoRA: only the adapters have optimizer state; one copy of the base weights (no reference copy).
    assert 0 < train["optimizer_state"] < 0.05 * train["weights"]
    assert train["weights"] < 2 * 3_059_456 * 4


# A rollout long enough for the KV cache to matter, and budgets small enough for several
# micro-batches per phase: what the fast estimate skips, the full-loop one runs.
LONG_ROLLOUT = TINY_PPO + [
    "--data.batch_size=32",
    "--data.max_prompt_length=8",
    "--model.generation.max_new_tokens=32",
    "--model.ppo.max_tokens_per_microbatch=128",
    "--model.ppo.logprob_max_tokens_per_microbatch=256",
]


@pytest.mark.parametrize("fake", [True, False], ids=["fake", "real"])
def test_ppo_fast_loops_equal_full_loops(fake, monkeypatch):
    """Generation's prefill + last decode step and two micro-batches per shape give the peaks of
    every decode step and every micro-batch, on fake tensors and on real CPU tensors."""
    import recipes.ppo

    losses = []
    original = recipes.ppo.PPOModule.loss
    monkeypatch.setattr(recipes.ppo.PPOModule, "loss", lambda self, mb: losses.append(len(mb)) or original(self, mb))
    fast = estimate("configs/ppo/tiny_cpu.yaml", LONG_ROLLOUT, fake=fake)
    fast_losses, losses[:] = len(losses), []
    full = estimate("configs/ppo/tiny_cpu.yaml", LONG_ROLLOUT, fake=fake, full_loops=True)
    # A mini-batch of 16 sequences of 40 tokens in 128-token micro-batches: five of 3 and one of 1;
    # the fast run keeps two of the first shape and the last one.
    assert (fast_losses, len(losses)) == (3, 6)
    _assert_close(fast, full)
    rollout = {p.phase: p for p in fast.phases}["rollout"].device_breakdown_bytes
    # The last decode step's cache: 32 sequences x (8 + 31) tokens x 4 layers x (k, v) x 4 heads x 32 x 4 B.
    assert rollout["kv_cache"] >= 32 * 39 * 4 * 2 * 4 * 32 * 4


# FSDP2 on 2 ranks: the estimate runs one unsharded process and derives each rank's bytes; the
# same step really sharded (lightning_mem.estimate.sharded: 2 CPU processes, gloo, the config's
# FSDP2Strategy sharding the recipe's model) is what it must match, rank by rank.
FSDP2 = "configs/sft/tiny_cpu_fsdp2.yaml"
TINY_PARAMS = 3_059_456
TINY_BLOCK_PARAMS = 725_504  # one LlamaDecoderLayer of tiny-llama
TINY_ROOT_PARAMS = TINY_PARAMS - 4 * TINY_BLOCK_PARAMS  # embeddings, head, final norm


@pytest.mark.parametrize("offload", [True, False], ids=["cpu_offload", "on_device"])
def test_sft_fsdp2_two_ranks_per_rank(offload):
    """The tiny FSDP2 SFT config (every block checkpointed), with and without CPU offload: each
    rank's device peak, host peak and every category against the estimate's per-rank figures."""
    overrides = [] if offload else ["--trainer.strategy.init_args.cpu_offload=false"]
    ranks = measure_sharded(FSDP2, overrides, world_size=2)
    fake = estimate(FSDP2, overrides, world_size=2)
    assert fake.world_size == 2 and len(ranks) == 2
    (est,) = fake.phases
    for phases in ranks:
        (real,) = phases
        assert real.phase == est.phase == "train"
        assert abs(est.device_peak_bytes - real.device_peak_bytes) <= 0.05 * real.device_peak_bytes, (est, real)
        assert abs(est.host_peak_bytes - real.host_peak_bytes) <= 0.05 * max(real.host_peak_bytes, 1), (est, real)
        for cat, value in real.device_breakdown_bytes.items():  # the same bytes, not only the same sum
            assert abs(est.device_breakdown_bytes[cat] - value) <= max(0.05 * value, 65536), (cat, est, real)
    worst = max(phases[0].device_peak_bytes for phases in ranks)
    assert abs(fake.device_peak_bytes - worst) <= 0.05 * worst

    # The sharding shows in what each rank really held at its peak.
    real = ranks[0][0].device_breakdown_bytes
    adamw = 2 * 4 * TINY_PARAMS  # exp_avg + exp_avg_sq, fp32, unsharded
    # Gathered for compute: the root unit and two blocks (the one computing, the one prefetched);
    # each parameter's rows are padded to an even split over the ranks (at most a few KB).
    gathered = 4 * (TINY_ROOT_PARAMS + 2 * TINY_BLOCK_PARAMS)
    if offload:  # shards, their gradients and the optimizer live on the host: half of each per rank
        assert real["optimizer_state"] == 0
        assert gathered <= real["weights"] <= gathered + 4096
        assert ranks[0][0].host_peak_bytes >= (4 + 4 + 8) * TINY_PARAMS / 2
    else:  # half the optimizer state per rank; half the weights plus the gathered units
        assert adamw / 2 <= real["optimizer_state"] <= adamw / 2 + 4096
        assert 4 * TINY_PARAMS / 2 + gathered <= real["weights"] <= 4 * TINY_PARAMS / 2 + gathered + 8192


def test_ppo_fsdp2_two_ranks_per_rank():
    """PPO under FSDP2 on 2 ranks (actor, critic and reference each sharded per block; CPU offload;
    checkpointing; activation offload): every phase of each rank against the estimate."""
    config = "configs/ppo/tiny_cpu_fsdp2.yaml"
    ranks = measure_sharded(config, TINY_PPO, world_size=2)
    fake = estimate(config, TINY_PPO, world_size=2)
    assert [p.phase for p in fake.phases] == ["rollout", "score", "train"]
    for phases in ranks:
        _assert_close(fake, type(fake)(config, fake.recipe, 2, fake.strategy, phases))
        est, real = fake.phases[-1].device_breakdown_bytes, phases[-1].device_breakdown_bytes
        # In the update the critic's last reduce-scatter input and root gradients wait while the
        # actor's backward runs: the gradients in flight are followed per model.
        assert abs(est["gradients"] - real["gradients"]) <= 65536, (est, real)
        # The estimate counts every model's root unit as gathered (the reference's too): never less.
        assert all(f.device_peak_bytes >= r.device_peak_bytes - 65536 for f, r in zip(fake.phases, phases))
