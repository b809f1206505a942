"""Learning-rate schedules that take plain numbers, so a YAML ``lr_scheduler`` can name them."""

from __future__ import annotations

import math

import torch


class WarmupCosineLR(torch.optim.lr_scheduler.LambdaLR):
    """Linear warmup over ``warmup_steps``, then cosine decay to ``min_lr_ratio`` x the peak at ``total_steps``."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_steps: int,
        total_steps: int,
        min_lr_ratio: float = 0.1,
        last_epoch: int = -1,
    ) -> None:
        if total_steps <= 0 or warmup_steps < 0 or warmup_steps > total_steps:
            raise ValueError(
                f"WarmupCosineLR needs 0 <= warmup_steps <= total_steps, total_steps > 0; got {warmup_steps}, {total_steps}"
            )
        self.warmup_steps, self.total_steps, self.min_lr_ratio = warmup_steps, total_steps, min_lr_ratio
        super().__init__(optimizer, self._factor, last_epoch=last_epoch)

    def _factor(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
