"""Critic-free advantages beyond GRPO: RLOO, REINFORCE++ and REINFORCE++ with a group baseline,
ReMax (a greedy answer's score as baseline), OPO (a length-weighted group baseline) and GRPO's
pass@k form.

(GAE and GRPO live in :mod:`lightning_mem.rl.algorithms`.) Same conventions: ``scores`` ``[N]`` is
each response's outcome score, ``group_ids`` ``[N]`` names the prompt it answers, ``mask``
``[N, R]`` marks response tokens; the result is ``[N, R]``, 0 on padding. Group statistics are
computed with scatter sums in float64, with no Python loop over groups.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

from lightning_mem.rl.algorithms import Reduce, single_process, whiten
from lightning_mem.rl.masking import masked as _masked

AdvantageEstimator = Literal[
    "gae", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "remax", "opo", "grpo_passk"
]
ADVANTAGE_ESTIMATORS: tuple[str, ...] = get_args(AdvantageEstimator)
#: The estimators that learn a value function (the rest build no critic).
WITH_CRITIC = ("gae",)
#: The estimators that compare the answers to one prompt (they sample ``grpo.group_size`` per prompt).
GROUPED = ("grpo", "rloo", "reinforce_pp_baseline", "opo", "grpo_passk")
#: The estimators whose baseline is the score of one extra greedy answer per prompt (the rollout
#: phase generates it, the score phase scores it).
GREEDY_BASELINE = ("remax",)


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
    """G_t = r_t + gamma * G_{t+1} over each response (0 after its last token and on padding).
    A masked-out position inside a row (a multi-turn observation) is skipped: ``t + 1`` is the next
    sampled token, as in :func:`~lightning_mem.rl.algorithms.gae_advantages`."""
    rewards = _masked(rewards, mask)
    out = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        m = mask[:, t].bool()
        running = torch.where(m, rewards[:, t] + gamma * running, running)
        out[:, t] = torch.where(m, running, 0.0)
    return out


def reinforce_pp_advantages(
    token_rewards: Tensor, mask: Tensor, *, gamma: float = 1.0, reduce: Reduce = single_process
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
    scores: Tensor, group_ids: Tensor, mask: Tensor, *, reduce: Reduce = single_process
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


def remax_advantages(token_rewards: Tensor, baseline_scores: Tensor, mask: Tensor) -> Tensor:
    """ReMax (Li et al. 2023, "ReMax: A Simple, Effective, and Efficient Reinforcement Learning
    Method for Aligning Large Language Models", arXiv 2310.10505):

        A_i,t = sum_{s >= t} r_i,s  -  r(x_i, y~_i)

    the return from token t (the score on the last token, minus the KL penalty on every token when
    it is in the reward; undiscounted) minus the score of the *greedy* answer ``y~_i`` to the same
    prompt (``baseline_scores`` ``[N]``): REINFORCE with a baseline that costs one greedy decode per
    prompt and no critic. Same as verl's ``compute_remax_outcome_advantage`` (its
    ``reward_baselines``); no whitening.
    """
    returns = discounted_returns(token_rewards, mask, gamma=1.0)
    return _masked(returns - baseline_scores.to(returns.dtype).unsqueeze(1), mask)


def opo_advantages(scores: Tensor, group_ids: Tensor, mask: Tensor) -> Tensor:
    """OPO (Hao et al. 2025, "On-Policy RL with Optimal Reward Baseline", arXiv 2505.23585): the
    group baseline that minimises the gradient's variance when the gradient norm grows with the
    response length, the length-weighted mean score:

        A_i = r_i - (sum_j |o_j| r_j) / (sum_j |o_j|)      (j over the answers to i's prompt)

    ``|o_j|`` is the response's length (``mask``'s row sum). Same as verl's
    ``compute_opo_outcome_advantage``, except that a group of one is an error here (verl gives it a
    baseline of 0; the recipe samples ``grpo.group_size`` >= 2 answers per prompt).
    """
    lengths = mask.to(torch.float64).sum(dim=1)
    weighted, _, inverse = group_sums(scores.to(torch.float64) * lengths, group_ids)
    total_length, count, _ = group_sums(lengths, group_ids)
    if bool((count < 2).any()):
        raise ValueError("OPO needs at least two responses per prompt (`grpo.group_size` >= 2)")
    baseline = weighted[inverse] / total_length[inverse].clamp(min=1)
    return _per_token(scores.to(torch.float64) - baseline, mask)


def grpo_passk_advantages(
    scores: Tensor, group_ids: Tensor, mask: Tensor, *, eps: float = 1e-6, scale: bool = True
) -> Tensor:
    """GRPO for pass@k (Tang et al. 2025, "Optimizing Language Models for Inference Time Objectives
    using Reinforcement Learning", arXiv 2503.19595): the group's objective is its best score, and
    only the best answer gets credit, by how much it beat the runner-up:

        A_i = (r_max - r_second) / (std_j r_j + eps)   for the best answer i of its group, 0 for the others

    (the leave-one-out baseline of max: the group's max without i is the second best). ``scale=False``
    skips the division by the group's (unbiased) standard deviation (``grpo.scale_rewards``, verl's
    ``norm_adv_by_std_in_grpo``). A tie at the top gives every answer 0. Same as verl's
    ``compute_grpo_passk_outcome_advantage``.
    """
    scores64 = scores.to(torch.float64)
    adv = torch.zeros_like(scores64)
    for gid in torch.unique(group_ids):
        members = torch.nonzero(group_ids == gid).flatten()
        group = scores64[members]
        if group.numel() < 2:
            raise ValueError("pass@k GRPO needs at least two responses per prompt (`grpo.group_size` >= 2)")
        top, where = torch.topk(group, 2)
        gap = top[0] - top[1]
        adv[members[where[0]]] = gap / (group.std() + eps) if scale else gap
    return _per_token(adv, mask)
