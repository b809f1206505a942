"""CI gate: every shipped GPU-tier config fits its tier by the estimator, and its header says so.

A GPU-tier config is a ``configs/*/*.yaml`` not named ``tiny_*``. Its tier (GPUs x GB per GPU) is
its ``# tier: NxMGB`` header line; its header also carries the estimator's per-phase peaks as
``# estimated peak per rank (GiB): <phase>=<value> ...``, which must agree with a fresh estimate
within 5 %. Every phase's peak must be at most the tier's device memory less the margin. A config
with separate placement runs on the tier's GPUs less its generating ones, and its header names a
training rank's phases and then a generating rank's (``load_weights``, ``generate``).

The gate is its own step of ``make test`` (marker ``config_gate``, two workers), after the main
suite. PPO configs are in it too: their estimate runs generation's prefill and last decode
step, two micro-batches per shape and the first mini-batch (the shortcuts of
``lightning_mem.estimate.run.EstimateRun``), 5-31 s per config on 2 idle cores (2026-11-28), not
the whole loops.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from lightning_mem.estimate import tier_of, usable_bytes
from lightning_mem.estimate.report import training_ranks
from tests.shipped_estimates import DPO_8B_GROUP, PPO_0_5B_GROUP, shipped_estimate

pytestmark = pytest.mark.config_gate

ROOT = Path(__file__).resolve().parents[2]
GPU_CONFIGS = sorted(p for p in (ROOT / "configs").glob("*/*.yaml") if not p.name.startswith("tiny_"))
HEADER = re.compile(r"^# estimated peak per rank \(GiB\):((?:\s+\w+=[0-9.]+)+)", re.MULTILINE)


def header_peaks(path: Path) -> dict[str, float]:
    match = HEADER.search(path.read_text())
    assert match, f"{path.name}: no '# estimated peak per rank (GiB): phase=value ...' header line"
    return {k: float(v) for k, v in (item.split("=") for item in match.group(1).split())}


DPO_8B_LORA = ROOT / "configs" / "dpo" / "llama-3.1-8b_1x24gb.yaml"

# Configs too long to gate even in the gate's own step (none today: the 70B QLoRA config, 80 blocks
# of 4-bit layers through forward, recompute and backward on fake tensors, the costliest, takes
# about 30 s).
_SLOW: set[str] = set()


def _marks(path: Path) -> list:
    if "ZeroStrategy" in path.read_text() and importlib.util.find_spec("deepspeed") is None:
        return [pytest.mark.skip(reason="ZeroStrategy cannot be built without the deepspeed extra")]
    if f"{path.parent.name}/{path.name}" in _SLOW:
        return [pytest.mark.slow]
    if path.name == "qwen2.5-0.5b-instruct_1x24gb.yaml":  # test_cuda_model.py reads its estimate too
        return [pytest.mark.xdist_group(PPO_0_5B_GROUP)]
    if path == DPO_8B_LORA:  # the reference's cost below reads its estimate too
        return [pytest.mark.xdist_group(DPO_8B_GROUP)]
    return []


@pytest.mark.parametrize(
    "path", [pytest.param(p, id=f"{p.parent.name}/{p.name}", marks=_marks(p)) for p in GPU_CONFIGS]
)
def test_config_fits_its_tier_and_header(path: Path):
    tier = tier_of(path)
    assert tier is not None and f"# tier: {tier.gpus}x{tier.memory_gb}GB" in path.read_text(), path.name
    result = shipped_estimate(path, training_ranks(path, tier))
    limit = usable_bytes(tier.memory_bytes)
    for phase in result.every_phase:
        assert phase.device_peak_bytes <= limit, (
            f"{path.name}: {phase.phase} needs {phase.device_peak_bytes / 2**30:.2f} GiB per rank, "
            f"the {tier.gpus}x{tier.memory_gb}GB tier allows {limit / 2**30:.2f} GiB"
        )
    stated = header_peaks(path)
    measured = {p.phase: p.device_peak_bytes / 2**30 for p in result.every_phase}
    assert set(stated) == set(measured), (path.name, stated, measured)
    for name, value in measured.items():
        assert abs(stated[name] - value) <= 0.05 * value, (path.name, name, stated[name], value)


@pytest.mark.xdist_group(DPO_8B_GROUP)
def test_the_8b_lora_dpo_reference_costs_nothing_beyond_the_adapters_forward():
    """The shipped config's reference is the base with its adapters off; the same step with no
    reference forward at all (its log-probs looked up, ``precompute``) holds the same weights,
    gradients and optimizer state, and peaks within 1 MiB of it (the looked-up table against the
    forward's per-sequence sums): the base's forward without gradients keeps nothing to the policy's
    backward, and no weight is loaded twice."""
    shipped = {p.phase: p for p in shipped_estimate(DPO_8B_LORA, 1).phases}
    assert list(shipped) == ["train"]
    from lightning_mem.estimate import estimate

    looked_up = {p.phase: p for p in estimate(DPO_8B_LORA, ["--model.reference.mode=precompute"]).phases}
    assert list(looked_up) == ["precompute", "train"]
    with_forward, without = shipped["train"], looked_up["train"]
    for category in ("weights", "gradients", "optimizer_state", "logits"):
        assert with_forward.device_breakdown_bytes[category] == without.device_breakdown_bytes[category], category
    assert abs(with_forward.device_peak_bytes - without.device_peak_bytes) < 2**20
