"""Critic-free advantages beyond GRPO: RLOO, REINFORCE++ and REINFORCE++ with a group baseline.

(GAE and GRPO live in :mod:`lightning_mem.rl.algorithms`.) Same conventions: ``scores`` ``[N]`` is
each response's outcome score, ``group_ids`` ``[N]`` names the prompt it answers, ``mask``
``[N, R]`` marks response tokens; the result is ``[N, R]``, 0 on padding. Group statistics are
computed with scatter sums in float64, with no Python loop over groups.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

from lightning_mem.rl.algorithms import Reduce, _identity, _masked, whiten

AdvantageEstimator = Literal["gae", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"]
ADVANTAGE_ESTIMATORS: tuple[str, ...] = get_args(AdvantageEstimator)
#: The estimators that learn a value function (the rest build no critic).
WITH_CRITIC = ("gae",)
#: The estimators that compare the answers to one prompt (they sample ``grpo.group_size`` per prompt).
GROUPED = ("grpo", "rloo", "reinforce_pp_baseline")


def group_sums(values: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(sum, count, inverse)``: each group's sum and size, and each sample's group index into them."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n = int(inverse.max()) + 1 if inverse.numel() else 0
    values = values.to(torch.float64)
    total = torch.zeros(n, dtype=torch.float64, device=values.device).index_add_(0, inverse, values)
    count = torch.zeros(n, dtype=torch.float64, device=values.device).index_add_(0, inverse, torch.ones_like(values))
    return total, count, inverse


def _per_token(per_sample: Tensor, mask: Tensor) -> Tensor:
    return _masked(per_sample.to(torch.float32).unsqueeze(1).expand(mask.shape), mask)


def rloo_advantages(scores: Tensor, group_ids: Tensor, mask: Tensor) -> Tensor:
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024, "Back to Basics"):

        A_i = r_i - (1/(G-1)) sum_{j != i} r_j  =  G/(G-1) * (r_i - mean_j r_j)

    the baseline of each answer is the mean of the *other* answers to its prompt, so it does not
    depend on the answer itself (unbiased). A group whose answers all scored alike gets exactly 0.
    Same as verl's ``compute_rloo_outcome_advantage`` and TRL's ``RLOOTrainer``.
    """
    total, count, inverse = group_sums(scores, group_ids)
    if bool((count < 2).any()):
        raise ValueError("RLOO needs at least two responses per prompt (`grpo.group_size` >= 2)")
    r = scores.to(torch.float64)
    others_mean = (total[inverse] - r) / (count[inverse] - 1)
    return _per_token(r - others_mean, mask)


def discounted_returns(rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """G_t = r_t + gamma * G_{t+1} over each response (0 after its last token and on padding)."""
    rewards = _masked(rewards, mask)
    out = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(mask[:, t].bool(), rewards[:, t] + gamma * running, 0.0)
        out[:, t] = running
    return out


def reinforce_pp_advantages(
    token_rewards: Tensor, mask: Tensor, *, gamma: float = 1.0, reduce: Reduce = _identity
) -> Tensor:
    """REINFORCE++ (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning LLMs"):

        A_t = whiten_batch( sum_{s >= t} gamma^(s-t) r_s )

    with ``r_s`` the per-token rewards (the score on the last token, minus the KL penalty on every
    token: :func:`~lightning_mem.rl.algorithms.rewards_with_kl_penalty`), whitened over all
    response tokens of the batch on all ranks (the global baseline replaces the critic). Same as
    verl's ``compute_reinforce_plus_plus_outcome_advantage``.
    """
    return whiten(discounted_returns(token_rewards, mask, gamma), mask, reduce=reduce)


def reinforce_pp_baseline_advantages(
    scores: Tensor, group_ids: Tensor, mask: Tensor, *, reduce: Reduce = _identity
) -> Tensor:
    """REINFORCE++-baseline (Hu 2025, sec. on reasoning tasks): subtract each prompt's mean score,
    give it to every token, then whiten over the batch's tokens (all ranks):

        A_i,t = whiten_batch( r_i - mean_{j in group(i)} r_j )

    The group mean removes the prompt's difficulty; the batch whitening (not GRPO's per-group std)
    keeps groups of low variance from being blown up. Same as verl's
    ``compute_reinforce_plus_plus_baseline_outcome_advantage``. A batch whose every group scored
    all alike has nothing to whiten and gets 0.
    """
    total, count, inverse = group_sums(scores, group_ids)
    centred = _per_token(scores.to(torch.float64) - total[inverse] / count[inverse], mask)
    # All alike: mean 0 and variance 0, so whitening gives (0 - 0) * rsqrt(0 + eps) = exactly 0.
    return whiten(centred, mask, reduce=reduce)
