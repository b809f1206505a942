"""A user's subclass of the SFT recipe whose step keeps more alive than its parent's: one more
no-grad forward's fp32 logits, held until the step's optimizer step (a metric computed late, say).
The memory estimate must see it (tests/estimate/test_estimate_accuracy.py)."""

from __future__ import annotations

from typing import Any

import torch

from lightning_mem.data import SFTDataModule  # noqa: F401  (the estimate finds the recipe's datamodule here)
from recipes.sft import SFTModule


class SFTKeepsLogits(SFTModule):
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        with torch.no_grad():
            self.kept = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.kept = None
