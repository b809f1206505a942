"""The DPO recipe's estimate by phase (``configs/dpo/tiny_cpu.yaml``, fp32, on fake tensors).

``precompute`` reports its pass over the data before the first step as a phase of its own (the
reference's weights and one no-gradient scoring, no gradients and no optimizer state yet) and then
``train`` without any reference; the other modes run the reference's forward inside ``train``: a
frozen copy adds one model's weights to the step, a host-parked copy adds them to the host only,
and a LoRA policy's base with its adapters off adds nothing at all.
"""

from __future__ import annotations

import pytest

from lightning_mem.estimate import estimate

CONFIG = "configs/dpo/tiny_cpu.yaml"
# The config starts from the SFT demo's export, which a fresh clone has not made yet: the same
# architecture from its config-only folder.
TINY = ["--model.name_or_path=assets/tiny-llama"]
TINY_PARAMS = 3_059_456  # tiny-llama, fp32 (4 bytes a parameter)
LORA = ["--model.lora={r: 8, lora_alpha: 16, lora_dropout: 0.0, target_modules: all-linear}"]


def _phases(*overrides: str) -> dict:
    return {p.phase: p for p in estimate(CONFIG, [*TINY, *overrides]).phases}


@pytest.fixture(scope="module")
def by_mode() -> dict[str, dict]:
    return {mode: _phases(f"--model.reference.mode={mode}") for mode in ("copy", "host", "precompute")}


def test_precompute_reports_its_pass_then_a_step_without_reference(by_mode):
    phases = by_mode["precompute"]
    assert list(phases) == ["precompute", "train"]
    scoring = phases["precompute"].device_breakdown_bytes
    assert scoring["optimizer_state"] == 0 and scoring["gradients"] == 0  # before the first step
    assert scoring["activations"] > 0
    # The policy's starting weights score the pass (a full fine-tune loads nothing else), and the
    # step holds them alone: no reference in training.
    assert 4 * TINY_PARAMS <= scoring["weights"] < 4 * TINY_PARAMS + 1024  # + the rotary buffers
    assert phases["train"].device_breakdown_bytes["weights"] == scoring["weights"]
    assert phases["train"].device_breakdown_bytes["optimizer_state"] >= 8 * TINY_PARAMS  # AdamW's two moments


def test_a_reference_forward_is_part_of_the_step(by_mode):
    policy = by_mode["precompute"]["train"].device_breakdown_bytes["weights"]
    copy, host = by_mode["copy"], by_mode["host"]
    assert list(copy) == ["train"] and list(host) == ["train"]
    assert copy["train"].device_breakdown_bytes["weights"] == 2 * policy  # a frozen copy on the device
    assert copy["train"].host_peak_bytes == 0
    # Parked on the host: the device holds the policy's weights at the step's peak, the host the copy.
    assert host["train"].device_breakdown_bytes["weights"] == policy
    assert host["train"].host_peak_bytes == policy
    assert host["train"].device_peak_bytes == copy["train"].device_peak_bytes - policy


def test_a_lora_reference_costs_nothing_beyond_the_adapters_forward():
    adapters_off = _phases(*LORA, "--model.reference.mode=adapters_off")
    precomputed = _phases(*LORA, "--model.reference.mode=precompute")
    assert list(adapters_off) == ["train"]
    # The same step with no reference forward at all (its values looked up): the same weights,
    # gradients and state, and the same peak but for a few hundred bytes (the precomputed table, 8
    # bytes a pair, against the forward's per-sequence sums): the base's forward without gradients
    # runs before the policy's and keeps nothing to its backward.
    off, looked_up = adapters_off["train"], precomputed["train"]
    for category in ("weights", "gradients", "optimizer_state", "logits"):
        assert off.device_breakdown_bytes[category] == looked_up.device_breakdown_bytes[category], category
    assert abs(off.device_peak_bytes - looked_up.device_peak_bytes) < 1024
    assert precomputed["precompute"].device_breakdown_bytes["optimizer_state"] == 0
