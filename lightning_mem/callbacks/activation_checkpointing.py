"""Activation checkpointing as a callback, for runs without the FSDP2 strategy.

FSDP2Strategy checkpoints blocks itself (its ``activation_checkpointing`` argument), because under
FSDP2 the checkpoint must be applied before sharding. A single-device or DDP run has no such
step, so this callback applies the same non-reentrant, hook-based checkpoint to the decoder
blocks of every Hugging Face model in the LightningModule when fit starts.
"""

from __future__ import annotations

from typing import Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_mem.activation_checkpointing import POLICIES, Policy, checkpoint_blocks
from lightning_mem.module_tree import find_hf_models
from lightning_mem.settings import STRATEGY_ARGS, SettingError, callback_args, callback_key, settings_at


class ActivationCheckpointing(Callback):
    """Recompute each checkpointed block's activations in backward instead of keeping them.

    Args:
        every: checkpoint blocks 0, every, 2*every, ... (1 = every block).
        block_classes: class names of the blocks; default: each model's ``_no_split_modules``.
        frozen_models: also checkpoint models with no trainable parameter (they run no backward,
            so by default they are left alone).
        policy: ``full`` (recompute the whole block) or ``selective`` (keep matmul and attention
            outputs, recompute the rest); see :mod:`lightning_mem.activation_checkpointing`.
        offload_inputs: keep each checkpointed block's input on the host until backward.
        blocks: checkpoint the first ``blocks`` blocks instead of every ``every``-th.
        budget: a device budget (``"20GiB"``): the recipe CLI estimates the run before any model
            loads and sets ``blocks`` to the fewest whose estimated peak fits
            (:func:`lightning_mem.activation_checkpointing.fewest_blocks_within`).
    """

    def __init__(
        self,
        every: int = 1,
        block_classes: Optional[list[str]] = None,
        frozen_models: bool = False,
        policy: Policy = "full",
        offload_inputs: bool = False,
        blocks: Optional[int] = None,
        budget: Optional[str] = None,
    ) -> None:
        with settings_at(callback_args(self)):
            if every < 1:
                raise SettingError("every", f" must be >= 1, got {every}")
            if policy not in POLICIES:
                raise SettingError("policy", f" must be one of {POLICIES}, got {policy!r}")
            if blocks is not None and blocks < 0:
                raise SettingError("blocks", f" must be >= 0, got {blocks}")
        self.every = every
        self.block_classes = block_classes
        self.frozen_models = frozen_models
        self.policy = policy
        self.offload_inputs = offload_inputs
        self.blocks = blocks
        self.budget = budget
        self.checkpointed: dict[str, int] = {}  # model name -> number of checkpointed blocks

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from lightning_mem.strategies.fsdp2 import FSDP2Strategy

        if isinstance(trainer.strategy, FSDP2Strategy):
            # Under FSDP2 the checkpoint must wrap blocks before they are sharded, in the strategy.
            raise SettingError(callback_key(self), " under FSDP2Strategy: set"
                               f" `{STRATEGY_ARGS}.activation_checkpointing` instead of this callback")
        if self.budget is not None and self.blocks is None:
            raise SettingError(
                "budget", " is turned into `blocks` by the recipe command line before the run (it estimates the"
                " run); built in code, give `blocks` (or `every`) instead", siblings=("blocks", "every"),
                prefix=f"{callback_args(self)}.")
        models = find_hf_models(pl_module)
        if not models:
            raise SettingError(callback_key(self), ": the LightningModule holds no Hugging Face model to checkpoint")
        for name, model in models:
            if not self.frozen_models and not any(p.requires_grad for p in model.parameters()):
                continue
            try:
                chosen, blocks = checkpoint_blocks(model, self.every, self.block_classes, count=self.blocks,
                                                   policy=self.policy, offload_inputs=self.offload_inputs)
            except ValueError as err:  # no block of the classes: name them where they are set
                raise SettingError("block_classes", f": `{name}`: {err}", prefix=f"{callback_args(self)}.") from None
            self.checkpointed[name] = chosen
            rank_zero_info(f"ActivationCheckpointing: {chosen} of {blocks} blocks of `{name}` checkpointed"
                           f" ({self.policy}{', inputs on the host' if self.offload_inputs else ''})")
