"""OptimizerStateOffload: same weights as without it; state on the host between steps."""

from __future__ import annotations

from typing import Any

import bitsandbytes as bnb
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from memtest_utils import TinyLM, adamw, assert_same_parameters, fit

from lightning_mem.callbacks import OptimizerStateOffload
from lightning_mem.callbacks import optimizer_state_offload as module_under_test
from lightning_mem.offload import optimizer_state_location, optimizer_state_residency
from lightning_mem.optim import optimizer_state_bytes


class _LocationProbe(Callback):
    """Runs after OptimizerStateOffload in the callback list and notes where the state is."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []
        self.bytes_at_batch_end: list[tuple[int, int]] = []

    def _note(self, trainer: Any, when: str) -> None:
        self.seen.append((when, optimizer_state_location(trainer.optimizers[0])))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._note(trainer, "batch_start")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self._note(trainer, "before_step")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._note(trainer, "batch_end")
        optimizer = trainer.optimizers[0]
        self.bytes_at_batch_end.append((optimizer_state_residency(optimizer).bytes, optimizer_state_bytes(optimizer)))


def _adamw8bit(params: Any) -> torch.optim.Optimizer:
    return bnb.optim.AdamW8bit(params, lr=1e-3)


@pytest.mark.parametrize("optimizer", [adamw, _adamw8bit], ids=["AdamW", "AdamW8bit"])
def test_automatic_optimization_same_weights_state_on_host_between_steps(tmp_path, optimizer) -> None:
    baseline = TinyLM(optimizer=optimizer)
    fit(baseline, tmp_path / "baseline")

    module = TinyLM(optimizer=optimizer)
    probe = _LocationProbe()
    module_under_test._warning_cache.clear()
    with pytest.warns(UserWarning, match="saves no memory here"):
        trainer = fit(module, tmp_path / "offloaded", callbacks=[OptimizerStateOffload(), probe])

    assert_same_parameters(module, baseline)
    assert probe.seen == [("batch_start", "host"), ("before_step", "device"), ("batch_end", "host")] * 3
    # Everything the optimizer keeps was on the host at the end of each step.
    assert all(moved == total > 0 for moved, total in probe.bytes_at_batch_end)
    assert optimizer_state_location(trainer.optimizers[0]) == "device"  # as Lightning left it


def test_manual_optimization_offloads_after_every_step(tmp_path) -> None:
    baseline = TinyLM(manual=True, steps_per_batch=2)
    fit(baseline, tmp_path / "baseline", steps=4)

    module = TinyLM(manual=True, steps_per_batch=2)
    seen: list[str] = []
    module.probe = lambda when: seen.append(optimizer_state_location(module.optimizers().optimizer))
    fit(module, tmp_path / "offloaded", steps=4, callbacks=[OptimizerStateOffload()])

    assert_same_parameters(module, baseline)
    # Two steps per batch, two batches (max_steps counts optimizer steps): host after each one,
    # also between the two steps of one batch, where the next forward/backward runs.
    assert seen == ["host"] * 4
