"""The estimate's warm-up step is one micro-batch however many the config accumulates, and an
accumulating config's estimate still holds to the recipe's own run."""

from __future__ import annotations

import pytest

from lightning_mem.estimate import estimate, measure_fit
from lightning_mem.estimate.measure import filling_rows


@pytest.fixture(scope="module")
def sft_rows(tmp_path_factory) -> list[str]:
    return filling_rows(tmp_path_factory.mktemp("full_rows"))["sft"]


def test_the_warm_up_is_one_micro_batch_and_the_measured_step_two(monkeypatch, sft_rows):
    from recipes.sft import SFTModule

    calls: list[int] = []
    steps: list[int] = []
    training_step, on_before_optimizer_step = SFTModule.training_step, SFTModule.on_before_optimizer_step

    def counted_step(self, batch, batch_idx):
        calls.append(int(batch["input_ids"].shape[1]))
        return training_step(self, batch, batch_idx)

    def counted_optimizer_step(self, optimizer):
        steps.append(len(calls))
        return on_before_optimizer_step(self, optimizer)

    monkeypatch.setattr(SFTModule, "training_step", counted_step)
    monkeypatch.setattr(SFTModule, "on_before_optimizer_step", counted_optimizer_step)
    est = estimate("configs/sft/tiny_cpu.yaml", [*sft_rows, "--trainer.accumulate_grad_batches=16"])
    # One warm-up micro-batch of 8 tokens, stepped on its own; then two full ones, stepped together.
    assert calls == [8, 64, 64]
    assert steps == [1, 3]
    assert est.phases[0].shape.endswith("2 of 16 accumulated")


def test_an_accumulating_estimate_holds_to_the_run(sft_rows):
    overrides = [*sft_rows, "--trainer.accumulate_grad_batches=4"]
    est = estimate("configs/sft/tiny_cpu.yaml", overrides)
    (run,) = measure_fit("configs/sft/tiny_cpu.yaml", overrides, steps=2)  # 8 micro-batches, the last 4 measured
    assert [p.phase for p in run] == [p.phase for p in est.phases] == ["train"]
    e, r = est.phases[0], run[0]
    assert 0.98 * r.device_peak_bytes <= e.device_peak_bytes <= 1.05 * r.device_peak_bytes, (e, r)
    # The second micro-batch's backward adds to the first one's gradients: they are alive at the peak.
    assert e.device_breakdown_bytes["gradients"] == r.device_breakdown_bytes["gradients"] > 0
