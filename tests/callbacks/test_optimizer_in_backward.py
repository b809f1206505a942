"""OptimizerInBackward: same weights as plain AdamW, gradients freed in backward, clear limits."""

from __future__ import annotations

import re
import warnings

import bitsandbytes as bnb
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from memtest_utils import TinyLM, assert_same_parameters, fit

from lightning_mem.callbacks import OptimizerInBackward
from lightning_mem.settings import SettingError


class _GradsAfterBackward(Callback):
    def __init__(self) -> None:
        self.alive: list[int] = []

    def on_after_backward(self, trainer, pl_module):
        self.alive.append(sum(p.grad is not None for p in pl_module.parameters()))


def test_same_weights_as_adamw_and_no_gradient_survives_backward(tmp_path) -> None:
    baseline = TinyLM()
    fit(baseline, tmp_path / "baseline")

    module, probe = TinyLM(), _GradsAfterBackward()
    fit(module, tmp_path / "in_backward", callbacks=[OptimizerInBackward(), probe])
    assert_same_parameters(module, baseline)
    assert probe.alive == [0, 0, 0]


def _paged_adamw8bit(params):
    return bnb.optim.PagedAdamW8bit(params, lr=1e-3, weight_decay=0.01, min_8bit_size=40_000)


def test_bitsandbytes_paged_8bit_adamw_gives_the_weights_of_its_step_after_backward(tmp_path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # paged on CPU: bitsandbytes runs it unpaged and says so
        baseline = TinyLM(optimizer=_paged_adamw8bit)
        fit(baseline, tmp_path / "baseline")
        module, probe, callback = TinyLM(optimizer=_paged_adamw8bit), _GradsAfterBackward(), OptimizerInBackward()
        fit(module, tmp_path / "in_backward", callbacks=[callback, probe])
    assert probe.alive == [0, 0, 0]
    assert all(type(o) is bnb.optim.PagedAdamW8bit for o in callback.stepper.optimizers.values())
    for (name, p), q in zip(module.named_parameters(), baseline.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_checkpoint_carries_the_per_parameter_state(tmp_path) -> None:
    first = OptimizerInBackward()
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    fit(TinyLM(), tmp_path / "first", steps=2, callbacks=[first, checkpoint], enable_checkpointing=True)

    # Resume with max_steps already reached: Lightning restores, builds, and stops.
    resumed = OptimizerInBackward()
    fit(TinyLM(), tmp_path / "resumed", steps=2, callbacks=[resumed], ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    saved, restored = first.stepper.state_dict(), resumed.stepper.state_dict()
    assert saved.keys() == restored.keys() and len(saved) == len(list(TinyLM().parameters()))
    for name, state in saved.items():
        assert restored[name]["state"][0]["step"] == state["state"][0]["step"] == 2
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(restored[name]["state"][0][key], state["state"][0][key]), (name, key)


@pytest.mark.parametrize(
    ("trainer_kwargs", "message"),
    [
        (dict(accumulate_grad_batches=2), "`trainer.accumulate_grad_batches: 2`"),
        (dict(gradient_clip_val=1.0), "`trainer.gradient_clip_val: 1.0`"),
        (dict(strategy="ddp"), "`trainer.strategy` DDPStrategy on 1 process"),
    ],
    ids=["accumulation", "clipping", "ddp"],
)
def test_limits_fail_early_with_the_key_to_change(tmp_path, trainer_kwargs: dict, message: str) -> None:
    module = TinyLM()
    with pytest.raises(SettingError, match=r"^`trainer.callbacks\[OptimizerInBackward\]` cannot run with .*" + re.escape(message)):
        fit(module, tmp_path, callbacks=[OptimizerInBackward()], **trainer_kwargs)


def test_the_estimate_counts_the_per_parameter_state_as_optimizer_state_and_no_gradients_at_the_step() -> None:
    from pathlib import Path

    from lightning_mem.estimate import estimate

    config = Path(__file__).resolve().parents[2] / "configs" / "sft" / "tiny_cpu.yaml"
    args = ["--trainer.gradient_clip_val=null", "--model.optimizer=bitsandbytes.optim.PagedAdamW8bit"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        after = estimate(config, args, world_size=1).phases[0].device_breakdown_bytes
        fused = estimate(config, [*args, "--trainer.callbacks+=lightning_mem.callbacks.OptimizerInBackward"],
                         world_size=1).phases[0].device_breakdown_bytes
    assert fused["optimizer_state"] == after["optimizer_state"] > 0  # the same bitsandbytes state, tagged as such
    assert fused["gradients"] < after["gradients"]  # one gradient at a time instead of all at the step
