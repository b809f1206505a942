"""``torch.compile`` of each decoder block (regional compilation) as a callback.

Works with every strategy, FSDP2 included: only each block's ``forward`` is compiled, so the
hooks of activation checkpointing (callback or strategy option) and of FSDP2 stay eager around it
and the order of wrapping does not matter (:mod:`lightning_mem.compile`). Blocks compile on their
first call, so the first step is slow (tens of seconds on a CPU) and the rest are not.

YAML::

    trainer:
      callbacks:
        - class_path: lightning_mem.callbacks.CompileBlocks
          init_args: {backend: inductor}
"""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_mem.compile import check_compile_settings, compile_blocks
from lightning_mem.module_tree import find_hf_models
from lightning_mem.settings import SettingError, callback_args, callback_key, settings_at


class CompileBlocks(Callback):
    """Compile the forward of every decoder block of each Hugging Face model in the LightningModule.

    Args:
        backend: a ``torch.compile`` backend (``inductor``; ``aot_eager`` to check tracing without
            code generation).
        mode: ``None``/``"default"`` or ``"max-autotune-no-cudagraphs"``; CUDA-graph modes are
            refused (their memory pool is invisible to the estimate).
        fullgraph: fail on a graph break instead of running the rest of the block eagerly.
        dynamic: ``torch.compile``'s ``dynamic``; None lets it mark a length dynamic once a second
            one is seen (token-budget batches vary in length).
        block_classes: class names of the blocks; default: each model's ``_no_split_modules``.
        frozen_models: also compile models with no trainable parameter (a PPO reference or reward
            model); by default only trained models are.

    The memory estimate runs compiled blocks eagerly (fake tensors cannot run Inductor's kernels)
    and says so in its notes (:attr:`estimate_note`).
    """

    #: The line the memory estimate adds to its notes when this callback is in the config.
    estimate_note = ("CompileBlocks: blocks estimated eager (Inductor cannot run on fake tensors); a compiled"
                     " block saves no more for backward than eager, so activations are an upper bound")

    def __init__(
        self,
        backend: str = "inductor",
        mode: Optional[str] = None,
        fullgraph: bool = False,
        dynamic: Optional[bool] = None,
        block_classes: Optional[list[str]] = None,
        frozen_models: bool = False,
    ) -> None:
        with settings_at(callback_args(self)):
            check_compile_settings(backend, mode, device_type="cuda")  # the C++ compiler is checked in setup
        self.settings: dict[str, Any] = dict(backend=backend, mode=mode, fullgraph=fullgraph, dynamic=dynamic)
        self.block_classes = block_classes
        self.frozen_models = frozen_models
        self.compiled: dict[str, int] = {}  # model name -> number of compiled blocks

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Before configure_model: a run that cannot compile fails before any weight loads. The
        # memory estimate's CPU fit (under its dispatch mode) compiles nothing, so needs no compiler.
        if torch.utils._python_dispatch._get_current_dispatch_mode() is not None:
            return
        with settings_at(callback_args(self)):
            check_compile_settings(self.settings["backend"], self.settings["mode"],
                                   device_type=trainer.strategy.root_device.type)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        models = find_hf_models(pl_module)
        if not models:
            raise SettingError(callback_key(self), ": the LightningModule holds no Hugging Face model to compile")
        for name, model in models:
            if not self.frozen_models and not any(p.requires_grad for p in model.parameters()):
                continue
            try:
                compiled, blocks = compile_blocks(model, self.block_classes, **self.settings)
            except ValueError as err:  # no block of the classes: name them where they are set
                raise SettingError("block_classes", f": `{name}`: {err}", prefix=f"{callback_args(self)}.") from None
            self.compiled[name] = compiled
            rank_zero_info(f"CompileBlocks: {blocks} blocks of `{name}` compiled ({self.settings['backend']});"
                           " the first step compiles them")
