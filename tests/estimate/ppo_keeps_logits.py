"""A user's subclass of the PPO recipe whose update keeps more alive than its parent's: each
micro-batch's loss runs one more no-grad forward of the actor and holds its logits until the
optimizer step. The memory estimate must see it in the train phase, and only there
(tests/estimate/test_estimate_accuracy.py)."""

from __future__ import annotations

from typing import Any

import torch

from lightning_mem.data import PromptDataModule  # noqa: F401  (the estimate finds the recipe's datamodule here)
from recipes.ppo import PPOModule


class PPOKeepsLogits(PPOModule):
    def loss(self, mb: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        with torch.no_grad():
            self.kept = self.actor(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
        return super().loss(mb)

    def _optimizer_step(self) -> None:
        super()._optimizer_step()
        self.kept = None
