"""Keep optimizer state in host memory except while the optimizer steps."""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.utilities.rank_zero import WarningCache
from typing_extensions import override

# The offload functions are called through their module: the memory estimate attributes what
# `offload.optimizer_state_to_host` allocates to the host by wrapping it there.
from lightning_mem import offload
from lightning_mem.offload import optimizer_state_location

_warning_cache = WarningCache()


class OptimizerStateOffload(Callback):
    """Optimizer state lives on the host between steps; it is on the device only to step.

    The state comes back in ``on_before_optimizer_step`` (after the backward of the step, in
    automatic and manual optimization alike) and goes back to the host from the optimizer's own
    step post-hook, so every ``optimizer.step()`` is covered, also several per batch (PPO). A
    step the precision plugin skips (inf gradients under fp16) is caught at the end of the
    batch. Results are unchanged: the round trip is bit-exact. A paged optimizer's managed buffers
    are not copied but their pages prefetched to the host and back, where the GPU can page
    (:mod:`lightning_mem.paging`); where it cannot, they stay where the driver keeps them (the
    recipes run a paged optimizer unpaged there: :func:`lightning_mem.optim.page_where_supported`).

    The ledger (:func:`lightning_mem.offload.optimizer_state_residency`) says where each
    optimizer's state is and what moved; on CPU, where placement shows nothing, that is what
    tells the phases apart.

    Args:
        pin_memory: pin the host copies (default: when the state is on CUDA).
        non_blocking: asynchronous copies (the offload still waits for them before returning).

    Example (YAML)::

        trainer:
          callbacks:
            - class_path: lightning_mem.callbacks.OptimizerStateOffload
    """

    def __init__(self, pin_memory: Optional[bool] = None, non_blocking: bool = True) -> None:
        self.pin_memory = pin_memory
        self.non_blocking = non_blocking
        self._handles: list[Any] = []
        self._optimizers: list[torch.optim.Optimizer] = []

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and trainer.strategy.root_device.type == "cpu":
            _warning_cache.warn(
                "OptimizerStateOffload on CPU: host and device memory are the same, so it saves no memory "
                "here; the state is still copied out and back, so results do not change."
            )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After the optimizers exist and any checkpoint restored their state.
        self._optimizers = [unwrap_optimizer(o) for o in trainer.optimizers]
        for optimizer in self._optimizers:
            self._handles.append(optimizer.register_step_post_hook(self._after_step))
            self._to_host(optimizer)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        optimizer = unwrap_optimizer(optimizer)
        if optimizer_state_location(optimizer) == "host":
            offload.optimizer_state_to_device(optimizer, non_blocking=self.non_blocking)

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._to_host(optimizer)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        for optimizer in self._optimizers:
            if optimizer_state_location(optimizer) == "device":
                self._to_host(optimizer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Leave the optimizers as Lightning made them: state on the device, no hooks of ours.
        self._restore()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore()

    def _to_host(self, optimizer: torch.optim.Optimizer) -> None:
        offload.optimizer_state_to_host(optimizer, pin_memory=self.pin_memory, non_blocking=self.non_blocking)

    def _restore(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for optimizer in self._optimizers:
            if optimizer_state_location(optimizer) == "host":
                offload.optimizer_state_to_device(optimizer, non_blocking=self.non_blocking)
        self._optimizers = []


def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
