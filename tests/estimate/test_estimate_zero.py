"""DeepSpeed ZeRO in the estimator: the master-weight optimizer, the per-rank derivation, the peak.

The estimator does not run DeepSpeed's engine (its collectives and flat buffers do not run on fake
tensors). It runs the recipe's step with the client optimizer stepping fp32 master copies, as
DeepSpeed's ZeRO optimizer does (``MasterWeights``), and derives each rank's share from the
measured categories (``shard_per_rank``), taking the peak where one rank holds most.
"""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from lightning_mem.estimate import estimate
from lightning_mem.estimate.sharding import MasterWeights, shard_per_rank, sharding_of
from lightning_mem.estimate.tracker import CATEGORIES, MemoryLedger, TrackingMode
from lightning_mem.strategies.zero_config import zero_tier

TINY_PARAMS = 3_059_456  # tiny-llama


def _zero(preset: str, **overrides) -> types.SimpleNamespace:
    return types.SimpleNamespace(tier=zero_tier(preset, **overrides))


def test_master_weights_step_is_an_fp32_master_step_copied_back():
    torch.manual_seed(0)
    model = nn.Linear(16, 8).to(torch.bfloat16)
    reference = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    ledger = MemoryLedger()
    with TrackingMode(ledger):
        opt = MasterWeights.wrap(torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.01), ledger)
        model(torch.randn(4, 16, dtype=torch.bfloat16)).float().square().sum().backward()
        grads = [p.grad.float() for p in model.parameters()]
        opt.step()
    ref_opt = torch.optim.AdamW(reference, lr=0.1, weight_decay=0.01)
    for p, g in zip(reference, grads):
        p.grad = g
    ref_opt.step()
    for p, ref in zip(model.parameters(), reference):
        assert p.dtype == torch.bfloat16 and p.grad is None
        assert torch.equal(p, ref.detach().to(torch.bfloat16))
    # The state is fp32, on the masters, and counted as optimizer state.
    for _, master in opt.pairs:
        state = opt.state[master]
        assert state["exp_avg"].dtype == torch.float32
        assert ledger.category_of(master) == "optimizer_state"
        assert ledger.category_of(state["exp_avg_sq"]) == "optimizer_state"


def test_master_weights_leave_fp32_optimizers_alone():
    opt = torch.optim.AdamW(nn.Linear(4, 4).parameters())
    assert MasterWeights.wrap(opt, MemoryLedger()) is opt


def test_zero_tiers_per_rank_bytes():
    measured = {c: 0 for c in CATEGORIES}
    measured.update(weights=8_000, gradients=8_000, optimizer_state=48_000, activations=1_000)
    units = (1_000, 2_000)  # largest block, root unit (bf16 parameter bytes)

    # ZeRO-2: full bf16 weights, 1/8 of gradients and state, two reduce buckets (overlap_comm).
    out, host = shard_per_rank(measured, 0, sharding_of(_zero("zero2", reduce_bucket_size=100)), 8, units, 2)
    assert out == {**measured, "gradients": 1_000 + 2 * 100 * 2, "optimizer_state": 6_000}
    assert host == 0
    # ZeRO-3 + offload: weights, gradients and state on the host (the gradient partition as fp32);
    # on the device two gathered blocks and the root, their gradients, and one reduce bucket.
    out, host = shard_per_rank(measured, 0, sharding_of(_zero("zero3_offload", reduce_bucket_size=100)), 1, units, 2)
    assert out == {**measured, "weights": 2 * 1_000 + 2_000, "gradients": 1_000 + 2_000 + 100 * 2,
                   "optimizer_state": 0}
    assert host == 8_000 + 2 * 8_000 + 48_000
    # A bucket is never counted larger than the gradients it holds.
    out, _ = shard_per_rank(measured, 0, sharding_of(_zero("zero2")), 8, units, 2)
    assert out["gradients"] == 1_000 + 8_000


def test_sharded_peak_is_where_one_rank_holds_most():
    # Unsharded, the optimizer step (large sharded state) is the larger moment; per rank of 8,
    # the backward (activations, not sharded) is.
    ledger = MemoryLedger()
    sharding = sharding_of(_zero("zero2", reduce_bucket_size=1))
    ledger.view = lambda breakdown, host: shard_per_rank(breakdown, host, sharding, 8, (0, 0), 2)
    activations = torch.empty(1_000, dtype=torch.uint8)
    ledger.track(activations, "activations")
    del activations
    state = torch.empty(4_000, dtype=torch.uint8)
    ledger.track(state, "optimizer_state")
    assert ledger.peak_breakdown["activations"] == 1_000 and ledger.peak_breakdown["optimizer_state"] == 0
    assert ledger.peak_bytes == 1_000


@pytest.fixture
def _deepspeed():
    pytest.importorskip("deepspeed")


def _tiny_zero(preset: str, world_size: int):
    overrides = ["--trainer.strategy=lightning_mem.strategies.deepspeed.ZeroStrategy",
                 f"--trainer.strategy.preset={preset}", "--trainer.precision=bf16-true"]
    (phase,) = estimate("configs/sft/tiny_cpu.yaml", overrides, world_size=world_size).phases
    return phase


def test_zero2_keeps_bf16_weights_and_shards_fp32_master_state(_deepspeed):
    phase = _tiny_zero("zero2", 4)
    b = phase.device_breakdown_bytes
    assert 2 * TINY_PARAMS <= b["weights"] <= 2 * TINY_PARAMS + 4096  # bf16, every rank (+ rotary buffer)
    # fp32 master weights + two fp32 Adam moments, a quarter per rank (+ the step counters).
    assert 12 * TINY_PARAMS // 4 <= b["optimizer_state"] <= 12 * TINY_PARAMS // 4 + 1024
    assert phase.host_peak_bytes == 0


def test_zero3_offload_keeps_only_gathered_units_on_the_device(_deepspeed):
    phase = _tiny_zero("zero3_offload", 1)
    b = phase.device_breakdown_bytes
    assert b["optimizer_state"] == 0
    assert 0 < b["weights"] < 2 * TINY_PARAMS  # two blocks and the root unit, not the model
    # The host's peak, at the optimizer step: bf16 weights 2 + fp32 gradients 4 + fp32 master
    # weights 4 + Adam moments 8 bytes per parameter, plus the step's temporaries.
    assert 18 * TINY_PARAMS <= phase.host_peak_bytes <= 20 * TINY_PARAMS
