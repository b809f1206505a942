"""Activation offload as a Lightning callback.

:class:`ActivationOffload` keeps an offloader active around every training batch (automatic and
manual optimization, any number of forward passes), pauses it during backward, and logs
``activation_offload/stashed_bytes`` per step. The technique itself (what is stashed, and how, on
CPU and CUDA) is :class:`lightning_mem.activation_offload.ActivationOffloader`.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import WarningCache
from typing_extensions import override

from lightning_mem.activation_offload import ActivationOffloader, ActivationOffloadStats
from lightning_mem.settings import callback_args, settings_at

_warning_cache = WarningCache()


class ActivationOffload(Callback):
    """Offload saved activations to host memory around every training batch.

    The hooks are installed at ``on_train_batch_start`` and removed at ``on_train_batch_end``,
    so every forward pass of the step is covered, whether Lightning runs it (automatic
    optimization) or the ``training_step`` runs several forward/backward passes itself (manual
    optimization, PPO epochs). They are paused inside each backward. Validation runs without
    grad and saves nothing.

    Logs ``activation_offload/stashed_bytes`` (unique bytes copied to host in the last step)
    and ``activation_offload/stashed_tensors``; :attr:`last_stats` keeps the exact counters.

    Args: see :class:`ActivationOffloader` (the device comes from the trainer's strategy).

    Example (YAML)::

        trainer:
          callbacks:
            - class_path: lightning_mem.callbacks.ActivationOffload
              init_args: {min_bytes: 1048576, exclude_modules: [lm_head]}
    """

    def __init__(
        self,
        min_bytes: int = 1024,
        pin_memory: Optional[bool] = None,
        use_streams: bool = True,
        max_inflight: int = 4,
        prefetch: int = 2,
        exclude_modules: Optional[list[str]] = None,
    ) -> None:
        self._kwargs = dict(
            min_bytes=min_bytes,
            pin_memory=pin_memory,
            use_streams=use_streams,
            max_inflight=max_inflight,
            prefetch=prefetch,
            exclude_modules=tuple(exclude_modules or ()),
        )
        self.offloader: Optional[ActivationOffloader] = None
        self.last_stats: Optional[ActivationOffloadStats] = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        device = trainer.strategy.root_device
        if device.type == "cpu":
            _warning_cache.warn(
                "ActivationOffload on CPU: host and device memory are the same, so it saves no memory "
                "here; activations are still copied out and back, so results do not change."
            )
        with settings_at(callback_args(self)):
            self.offloader = ActivationOffloader(pl_module, device=device, **self._kwargs)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        offloader = self._require_offloader()
        offloader.reset_stats()
        if not offloader.active:
            with settings_at(callback_args(self)):  # `exclude_modules` are looked up in the model here
                offloader.__enter__()

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self.offloader is not None and self.offloader.active:
            self.offloader.pause()

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.offloader is not None and self.offloader.active:
            self.offloader.resume()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._close()
        stats = self._require_offloader().stats
        self.last_stats = ActivationOffloadStats(**asdict(stats))
        pl_module.log("activation_offload/stashed_bytes", float(stats.stashed_bytes), on_step=True, on_epoch=False)
        pl_module.log("activation_offload/stashed_tensors", float(stats.stashed_tensors), on_step=True, on_epoch=False)

    # A batch can end without on_train_batch_end (a module hook returning -1 ends the epoch, an
    # exception): never leave the hooks installed behind the trainer's back.
    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._close()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._close()

    def _close(self) -> None:
        if self.offloader is not None and self.offloader.active:
            self.offloader.__exit__(None, None, None)

    def _require_offloader(self) -> ActivationOffloader:
        if self.offloader is None:
            raise RuntimeError("ActivationOffload: the trainer did not call setup(stage='fit') before training")
        return self.offloader
