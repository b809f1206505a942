"""Liger's fused Triton kernels (RMSNorm, SwiGLU, RoPE) on every Hugging Face model of the run.

CUDA only (``pip install 'lightning-mem[gpu]'``): on any other device the run stops in ``setup``,
before the model loads, with one message naming this callback. The kernels replace module
forwards in place, so they go on after the strategy has sharded or checkpointed the blocks, under
any strategy. Liger's fused linear cross-entropy is left off: see :mod:`lightning_mem.liger`.
What Liger rebinds for the whole process (RoPE's function, the model type's RMSNorm and MLP
classes) is put back when fit ends; the patched models keep their kernels.

YAML::

    trainer:
      callbacks:
        - class_path: lightning_mem.callbacks.LigerKernels
          init_args: {rope: true}
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_mem.liger import (
    ModulePatch,
    apply_liger_kernels,
    check_liger,
    liger_settings,
    record_module_patches,
    undo_module_patches,
)
from lightning_mem.module_tree import find_hf_models
from lightning_mem.settings import SettingError, SettingNotSupported, callback_key

class LigerKernels(Callback):
    """Apply Liger's kernels to each Hugging Face model in the LightningModule when fit starts.

    Args:
        rms_norm, swiglu, rope: which kernels (all by default).
        frozen_models: also patch models with no trainable parameter (a PPO reference or reward
            model); by default only trained models are. RoPE's patch is per model type, so it
            reaches every model of the trained one's type anyway.
    """

    #: Not run by the memory estimate (its fit is on a CPU, where Triton cannot run).
    runs_in_estimate = False
    #: The line the memory estimate adds to its notes when this callback is in the config.
    estimate_note = ("LigerKernels: estimated with the model's own modules (Liger's Triton kernels need CUDA);"
                     " Liger's SwiGLU and RMSNorm keep less for backward, so activations are an upper bound")

    def __init__(self, rms_norm: bool = True, swiglu: bool = True, rope: bool = True, frozen_models: bool = False) -> None:
        self.kernels = liger_settings(rms_norm=rms_norm, swiglu=swiglu, rope=rope)
        self.frozen_models = frozen_models
        self.patched: list[str] = []
        self._module_patches: list[ModulePatch] = []

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Before configure_model: a run that cannot use Liger stops before any weight loads.
        try:
            check_liger(trainer.strategy.root_device.type)
        except ValueError as err:
            raise SettingNotSupported(callback_key(self), f": {err}; remove the callback to run without it") from None

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        models = find_hf_models(pl_module)
        if not models:
            raise SettingError(callback_key(self), ": the LightningModule holds no Hugging Face model to patch")
        for name, model in models:
            if not self.frozen_models and not any(p.requires_grad for p in model.parameters()):
                continue
            try:
                _, rebound = record_module_patches(lambda model=model: apply_liger_kernels(model, **self.kernels))
            except ValueError as err:  # a model type Liger has no kernels for
                raise SettingNotSupported(callback_key(self), f": `{name}`: {err}; remove the callback to run"
                                          " without it") from None
            self._module_patches += rebound
            self.patched.append(name)
        on = [name for name, wanted in self.kernels.items() if wanted]
        rank_zero_info(f"LigerKernels: {', '.join(on) or 'no kernels'} on {', '.join(f'`{n}`' for n in self.patched)}")

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            undo_module_patches(self._module_patches)
            self._module_patches = []
