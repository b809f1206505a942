"""Fuse the optimizer step into backward so gradients never all exist at once."""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import SingleDeviceStrategy
from typing_extensions import override

from lightning_mem.callbacks.optimizer_state_offload import unwrap_optimizer
from lightning_mem.optim import StepInBackward
from lightning_mem.settings import SettingError, callback_key


class OptimizerInBackward(Callback):
    """Step every parameter from its post-accumulate-grad hook (single-device full fine-tuning).

    The optimizer configured by the module (``configure_optimizers``) is used as the template:
    each trainable parameter gets its own optimizer of the same class and settings (see
    :class:`lightning_mem.optim.StepInBackward`), and each gradient is freed right after its
    parameter's step. Lightning still calls the configured optimizer, which then has no
    gradients and does nothing; LR schedulers attached to it keep working. torch's optimizers and
    bitsandbytes' (``AdamW8bit``, ``PagedAdamW8bit``, ``PagedAdamW``: every 8-bit setting and the
    paging decision the recipe made for the platform are kept) give the weights of the step after
    backward.

    Gradient clipping: none. Clipping by the global norm needs every gradient at once, which is
    what this callback avoids (torchtune's rule too), so ``trainer.gradient_clip_val`` is refused;
    bitsandbytes' ``max_unorm`` (each parameter's update clipped by its own norm) is kept.

    Checked at setup, with an error naming the key to change: ``accumulate_grad_batches`` must be
    1, ``gradient_clip_val`` unset, a single device (``trainer.strategy``: not FSDP2, whose sharded
    gradients are reduced across ranks before any step), no fp16 gradient scaler, one optimizer.
    In manual optimization, call ``manual_backward`` once per optimizer step.

    The per-parameter optimizer states go into Lightning checkpoints through this callback's
    ``state_dict``.

    Example (YAML)::

        trainer:
          gradient_clip_val: null
          accumulate_grad_batches: 1
          callbacks:
            - class_path: lightning_mem.callbacks.OptimizerInBackward
    """

    def __init__(self) -> None:
        self.stepper: Optional[StepInBackward] = None
        self._pending_state: Optional[dict[str, Any]] = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        problems = []
        if trainer.accumulate_grad_batches != 1:
            problems.append(
                f"`trainer.accumulate_grad_batches: {trainer.accumulate_grad_batches}`: each backward steps, so "
                "gradients cannot accumulate; set it to 1"
            )
        if trainer.gradient_clip_val:
            problems.append(
                f"`trainer.gradient_clip_val: {trainer.gradient_clip_val}`: gradients are freed one by one, so "
                "there is never a global norm to clip by; set it to null (no clipping with the step in backward)"
            )
        if trainer.world_size > 1 or not isinstance(trainer.strategy, SingleDeviceStrategy):
            problems.append(
                f"`trainer.strategy` {type(trainer.strategy).__name__} on {trainer.world_size} process(es): "
                "gradients would need reducing across ranks before the step; use a single device (strategy: auto)"
            )
        if getattr(trainer.precision_plugin, "scaler", None) is not None:
            problems.append(
                "`trainer.precision` with a gradient scaler (16-mixed): a step cannot be skipped after the "
                "fact; use bf16-mixed or 32-true"
            )
        if problems:
            raise SettingError(callback_key(self), " cannot run with " + "; ".join(problems))

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if len(trainer.optimizers) != 1:
            raise SettingError(callback_key(self), f" needs exactly one optimizer (`configure_optimizers`), got"
                               f" {len(trainer.optimizers)}")
        self.stepper = StepInBackward(pl_module, unwrap_optimizer(trainer.optimizers[0]))
        if self._pending_state is not None:
            self.stepper.load_state_dict(self._pending_state)
            self._pending_state = None

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.stepper is not None:
            self.stepper.remove()

    @override
    def state_dict(self) -> dict[str, Any]:
        if self.stepper is None:
            return {}
        return {"optimizers": self.stepper.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Lightning restores callbacks before on_fit_start builds the per-parameter optimizers.
        state = state_dict.get("optimizers")
        if state is None:
            return
        if self.stepper is None:
            self._pending_state = state
        else:
            self.stepper.load_state_dict(state)
