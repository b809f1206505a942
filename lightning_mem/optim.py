"""Optimizer plumbing shared by the recipes: parameter groups and learning-rate schedules."""

from __future__ import annotations

import math

import torch
from torch import nn

# Parameters whose name ends with one of these, or that are 1-D (norm weights, biases), get no
# weight decay: decaying a norm's gain or a bias towards zero only hurts.
_NO_DECAY_SUFFIXES = ("bias",)


def param_groups(module: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups of trainable parameters: decayed (matrices) and not decayed (norms, biases).

    Frozen parameters are left out, so an optimizer never allocates state for them. The decayed
    group carries ``weight_decay`` only when it is given (not None): otherwise the optimizer's own
    default applies, so ``weight_decay`` set in the optimizer's YAML ``init_args`` still works.
    """
    decay, no_decay = [], []
    for name, param in module.named_parameters():
        if not param.requires_grad:
            continue
        if param.ndim < 2 or name.endswith(_NO_DECAY_SUFFIXES) or "norm" in name.lower():
            no_decay.append(param)
        else:
            decay.append(param)
    if not decay and not no_decay:
        raise ValueError("the model has no trainable parameters")
    groups = []
    if decay:
        groups.append({"params": decay} if weight_decay is None else {"params": decay, "weight_decay": weight_decay})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


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
