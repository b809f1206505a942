"""Linear layers that read the same fp32 input share one autocast copy of it (:mod:`lightning_mem.shared_casts`).

Every recipe adds it (``configure_callbacks``): it changes no number, and under ``bf16-mixed`` it
keeps three fewer ``[tokens, hidden]`` bf16 tensors per transformer block for backward. It acts
only under autocast, so under ``bf16-true``, FSDP2's mixed-precision policy or DeepSpeed's bf16
it finds nothing to share and costs nothing.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_mem.shared_casts import share_input_casts, unshare_input_casts


class SharedCasts(Callback):
    """Patch every plain ``nn.Linear`` of the LightningModule when fit starts; undo it when fit ends."""

    def __init__(self) -> None:
        self.layers = 0

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.layers = share_input_casts(pl_module)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            unshare_input_casts(pl_module)
