"""Which samples train, and DAPO's length shaping: the zero-variance group filter, the overlong
filter and the soft overlong penalty (Yu et al. 2025, "DAPO", sections 3.2 and 3.4).

A filter returns a boolean ``keep`` per sample; the recipe zeroes the loss mask of the others, so
they add nothing to the loss and are not counted by the aggregation
(:mod:`lightning_mem.rl.loss_aggregation`). DAPO itself over-samples prompts until the batch is
full of kept groups ("dynamic sampling"); here the batch keeps its size and the filtered samples
drop out of the update, which keeps every step's memory and time the same.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_mem.rl.advantages import group_sums
from lightning_mem.rl.algorithms import last_token_index


def varied_groups(scores: Tensor, group_ids: Tensor) -> Tensor:
    """``keep[i]``: sample i's group did not score all alike (DAPO's dynamic-sampling condition
    ``0 < |{correct}| < G``, for any score). A group with one score everywhere gives every
    group-relative advantage 0, so it only dilutes the update's normaliser. Exact equality (max ==
    min), not a variance threshold: float noise in a mean must not decide. Same test as verl's
    ``algorithm.filter_groups`` (metric ``std > 0``) and TRL's dynamic sampling."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n = int(inverse.max()) + 1 if inverse.numel() else 0
    s = scores.to(torch.float64)
    high = torch.full((n,), -torch.inf, dtype=torch.float64, device=s.device).scatter_reduce(0, inverse, s, "amax")
    low = torch.full((n,), torch.inf, dtype=torch.float64, device=s.device).scatter_reduce(0, inverse, s, "amin")
    return (high > low)[inverse]


def groups_filtered(keep: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor]:
    """``(filtered groups, groups)`` as float64 counts (sum over ranks for the fraction)."""
    dropped, count, _ = group_sums((~keep).to(torch.float64), group_ids)
    return (dropped > 0).sum().to(torch.float64), torch.tensor(float(count.numel()), dtype=torch.float64,
                                                               device=keep.device)


def truncated(response_ids: Tensor, response_mask: Tensor, eos_token_ids: list[int], max_new_tokens: int) -> Tensor:
    """``[N]`` bool: the response hit ``max_new_tokens`` without ending on an end-of-sequence token
    (cut off, its answer unfinished). Its last token is its last sampled one, wherever it sits (a
    multi-turn trajectory's mask has holes); its length counts sampled tokens only."""
    lengths = response_mask.sum(dim=1)
    last = response_ids.gather(1, last_token_index(response_mask).unsqueeze(1)).squeeze(1)
    ended = torch.zeros_like(last, dtype=torch.bool)
    for eos in eos_token_ids:
        ended |= last == eos
    return (lengths >= max_new_tokens) & ~ended


def overlong_penalty(lengths: Tensor, *, max_new_tokens: int, buffer: int, factor: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment (eq. 13), added to the score:

        R_length(y) = 0                                  if |y| <= L_max - L_cache
                    = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
                    = -1                                 if |y| > L_max

    times ``factor``; ``L_max`` is ``max_new_tokens`` and ``L_cache`` the ``buffer`` before it where
    the penalty ramps from 0 to -1. Same as verl's ``reward_model.overlong_buffer``
    (``len``, ``penalty_factor``) in DAPO's reward manager.
    """
    if not 0 < buffer <= max_new_tokens:
        raise ValueError(f"the overlong buffer must be in [1, max_new_tokens={max_new_tokens}], got {buffer}")
    expected = max_new_tokens - buffer
    excess = lengths.to(torch.float64) - expected
    return (-(excess / buffer).clamp(min=0.0, max=1.0) * factor).to(torch.float32)
