"""ActivationOffload, the callback: bit-identical fits (automatic and manual optimization), every
forward pass of a step covered, hooks removed on failure. The primitive it runs is tested in
tests/test_activation_offload_primitive.py."""

from __future__ import annotations

import pytest
import torch
from memtest_utils import TinyLM, assert_same_parameters, fit, lm_loss, saved_activation_bytes, token_batches

from lightning_mem.callbacks import ActivationOffload
from lightning_mem.callbacks import activation_offload as activation_offload_module
from lightning_mem.settings import SettingError


def _no_saved_tensor_hooks_installed() -> bool:
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is None


@pytest.mark.parametrize(
    "options",
    [dict(), dict(checkpointing=True), dict(manual=True, passes=2)],
    ids=["automatic", "automatic-checkpointed", "manual-2-passes"],
)
def test_fit_gives_bit_identical_weights(tmp_path, options: dict) -> None:
    baseline = TinyLM(**options)
    fit(baseline, tmp_path / "baseline")

    callback = ActivationOffload(min_bytes=0)
    offloaded = TinyLM(**options)
    activation_offload_module._warning_cache.clear()  # the CPU warning is emitted once per process
    with pytest.warns(UserWarning, match="saves no memory here"):
        trainer = fit(offloaded, tmp_path / "offloaded", callbacks=[callback])

    assert_same_parameters(offloaded, baseline)
    assert _no_saved_tensor_hooks_installed()
    # Every forward pass of the last step was covered: its bytes are the saved bytes of one
    # forward on the same batch, times the number of passes.
    last_batch = token_batches(8)[2]
    one_pass, _ = saved_activation_bytes(offloaded.model, lambda: lm_loss(offloaded.model, last_batch))
    stats = callback.last_stats
    assert stats.stashed_bytes == one_pass * options.get("passes", 1)
    assert stats.passed_through_tensors == 0  # nothing is saved inside a non-reentrant backward
    assert trainer.callback_metrics["activation_offload/stashed_bytes"].item() == float(stats.stashed_bytes)


def test_hooks_removed_when_training_step_raises(tmp_path) -> None:
    class Failing(TinyLM):
        def training_step(self, ids, batch_idx):
            lm_loss(self.model, ids)
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fit(Failing(), tmp_path, callbacks=[ActivationOffload()])
    assert _no_saved_tensor_hooks_installed()


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(max_inflight=0), "max_inflight` must be >= 1, got 0$"),
    (dict(exclude_modules=["no_such_module"]), r"exclude_modules`: no module of the model matches \['no_such_module'\]$"),
], ids=["range-at-setup", "exclusions-at-the-first-batch"])
def test_a_bad_argument_is_named_where_the_trainer_takes_it(tmp_path, kwargs: dict, message: str) -> None:
    activation_offload_module._warning_cache.clear()
    with pytest.warns(UserWarning, match="saves no memory here"), pytest.raises(
            SettingError, match=r"^`trainer.callbacks\[ActivationOffload\].init_args." + message):
        fit(TinyLM(), tmp_path, callbacks=[ActivationOffload(**kwargs)])
    assert _no_saved_tensor_hooks_installed()
