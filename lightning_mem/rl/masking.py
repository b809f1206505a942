"""Selecting the real (unmasked) tokens of a padded batch; shared by the advantage, loss and
rollout-correction modules."""

from __future__ import annotations

import torch
from torch import Tensor


def masked(values: Tensor, mask: Tensor) -> Tensor:
    """``values`` where ``mask`` is set, exactly 0 elsewhere.

    Selection, not multiplication: ``inf * 0`` and ``nan * 0`` are NaN, so a non-finite value at a
    padded position (a logit overflow, an uninitialised buffer, a value head on a pad token) would
    otherwise poison every sum it enters, and its gradient too.
    """
    return torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))
