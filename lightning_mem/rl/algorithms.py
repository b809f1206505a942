"""The arithmetic of PPO and GRPO on padded ``[batch, response_length]`` tensors.

Every per-token tensor here is *response-aligned*: row ``i`` holds sample ``i``'s response
tokens from column 0, and ``mask`` is 1 on real response tokens and 0 on padding. Functions are
pure (no module state, no process group) except where a ``reduce`` callable is passed in, so the
same code runs single-process and across ranks, and every line can be checked by hand.

Conventions (Schulman et al. 2017; Ziegler et al. 2019; Shao et al. 2024):

- ``logprobs``/``old_logprobs``/``ref_logprobs``: log pi(token | prefix) of each response token.
- KL estimators of KL(pi || pi_ref) from samples of pi, with ``log_ratio = logprobs - ref_logprobs``
  (Schulman, "Approximating KL divergence"): k1 = log_ratio (unbiased, can be negative),
  k2 = log_ratio**2 / 2 (biased, low variance), k3 = exp(-log_ratio) - 1 + log_ratio (unbiased,
  never negative).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

from lightning_mem.rl.masking import masked as _masked

#: The per-token KL estimators (a YAML setting takes the Literal, code iterates the tuple).
KLEstimator = Literal["k1", "k2", "k3", "abs"]
KL_ESTIMATORS: tuple[str, ...] = get_args(KLEstimator)

#: ``reduce(tensor) -> tensor`` summing over ranks; the identity in a single process.
Reduce = Callable[[Tensor], Tensor]


def single_process(t: Tensor) -> Tensor:
    """The :data:`Reduce` of one process: its own sum is the sum."""
    return t


# ---------------------------------------------------------------------------------------------
# Masked statistics
# ---------------------------------------------------------------------------------------------


def masked_sum(values: Tensor, mask: Tensor) -> Tensor:
    return _masked(values, mask).sum()


def masked_mean(values: Tensor, mask: Tensor, reduce: Reduce = single_process) -> Tensor:
    """Mean over the tokens where ``mask`` is 1, over all ranks when ``reduce`` sums across them."""
    stats = reduce(torch.stack([masked_sum(values.to(torch.float64), mask), mask.sum().to(torch.float64)]))
    return (stats[0] / stats[1].clamp(min=1)).to(values.dtype)


def masked_mean_var(values: Tensor, mask: Tensor, reduce: Reduce = single_process) -> tuple[Tensor, Tensor]:
    """Mean and unbiased (Bessel-corrected) variance over masked tokens, across ranks if asked.

    Computed from the sums of x and x**2 in float64 so that one all-reduce of three numbers
    gives the global statistics (whitening over the whole batch, not per rank: the advantages
    then do not depend on how samples are spread across ranks).
    """
    v = _masked(values.to(torch.float64), mask)
    m = mask.to(torch.float64)
    stats = reduce(torch.stack([v.sum(), (v * v).sum(), m.sum()]))
    total, total_sq, count = stats[0], stats[1], stats[2]
    if count < 2:
        raise ValueError("whitening needs at least two unmasked tokens")
    mean = total / count
    var = (total_sq - count * mean * mean) / (count - 1)
    return mean.to(values.dtype), var.clamp(min=0).to(values.dtype)


def whiten(values: Tensor, mask: Tensor, *, shift_mean: bool = True, eps: float = 1e-8, reduce: Reduce = single_process) -> Tensor:
    """(x - mean) / sqrt(var + eps) over masked tokens; padding stays 0.

    ``shift_mean=False`` only rescales (keeps the mean): used for rewards, whose sign carries
    meaning; advantages are centred.
    """
    values = _masked(values, mask)  # before any arithmetic: inf - mean at padding would NaN the backward
    mean, var = masked_mean_var(values, mask, reduce)
    out = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return _masked(out, mask)


# ---------------------------------------------------------------------------------------------
# KL penalty and rewards
# ---------------------------------------------------------------------------------------------


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k1", mask: Tensor | None = None) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) for tokens sampled from pi (see module docstring).

    With ``mask``, padded positions are 0 and pass no gradient, whatever the logprobs hold there
    (exp of an inf log-ratio would otherwise make the backward NaN).
    """
    log_ratio = logprobs - ref_logprobs
    if mask is not None:
        log_ratio = _masked(log_ratio, mask)
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        # exp(-x) - 1 + x >= 0 for every x: never rewards moving towards the reference "too much".
        return torch.expm1(-log_ratio) + log_ratio
    if estimator == "abs":
        return log_ratio.abs()
    raise ValueError(f"unknown KL estimator {estimator!r}; choose one of {KL_ESTIMATORS}")


def last_token_index(mask: Tensor) -> Tensor:
    """Column of each row's last unmasked token (0 for an empty row); a mask with holes (a
    multi-turn trajectory's observations) too."""
    if mask.shape[1] == 0:
        return torch.zeros(mask.shape[0], dtype=torch.long, device=mask.device)
    columns = torch.arange(mask.shape[1], device=mask.device)
    return torch.where(mask.bool(), columns, 0).amax(dim=1)


def rewards_with_kl_penalty(scores: Tensor, kl: Tensor, mask: Tensor, kl_coef: float) -> Tensor:
    """Per-token rewards: ``-kl_coef * kl`` on every response token, plus the sequence's score on its
    last token (where the reward function or model judged the whole response)."""
    rewards = _masked(-kl_coef * kl, mask)
    rows = torch.arange(scores.shape[0], device=scores.device)
    rewards[rows, last_token_index(mask)] += scores.to(rewards.dtype)
    return rewards


# ---------------------------------------------------------------------------------------------
# Advantages
# ---------------------------------------------------------------------------------------------


def gae_advantages(
    rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float = 1.0, lam: float = 0.95
) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016) over each response.

    delta_t = r_t + gamma * V_{t+1} - V_t, with V = 0 after the last response token (the episode
    ends there); A_t = delta_t + gamma * lam * A_{t+1}. Returns ``(advantages, returns)`` with
    returns = A + V, the value targets. Padding positions are 0 in both.

    The recursion runs over the masked-in tokens only: a masked-out position inside a row (a
    multi-turn trajectory's observation tokens, which the policy did not choose) is skipped, so
    ``t + 1`` is the next *sampled* token and the value bootstraps across the observation, which
    is a transition of the environment, not a step of the policy (verl's multi-turn GAE does the
    same). With a prefix mask this is the plain recursion.
    """
    values = _masked(values, mask)
    rewards = _masked(rewards, mask)
    length = rewards.shape[1]
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(length)):
        m = mask[:, t].bool()
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        # A masked-out position passes both through unchanged: after a row's last token they are
        # still 0 (the episode's end), inside a row they carry the next sampled token's over the gap.
        running = torch.where(m, delta + gamma * lam * running, running)
        advantages[:, t] = torch.where(m, running, 0.0)
        next_value = torch.where(m, values[:, t], next_value)
    returns = advantages + values
    return advantages, _masked(returns, mask)


def grpo_advantages(scores: Tensor, group_ids: Tensor, mask: Tensor, *, eps: float = 1e-6, scale: bool = True) -> Tensor:
    """GRPO's outcome advantages (Shao et al. 2024): each response's score minus its group's mean,
    divided by the group's (unbiased) standard deviation, given to every token of the response.

    ``group_ids[i]`` names the prompt sample ``i`` answers; a group whose responses all score the
    same gets advantage 0 (nothing to prefer). ``scale=False`` skips the division (Dr. GRPO).
    """
    # float64 statistics and an exact all-equal test: in fp32 the mean of eight scores of 0.45 is
    # one unit in the last place off, so "identical" scores would get a +-0.03 advantage each.
    scores = scores.to(torch.float64)
    adv = torch.zeros_like(scores)
    for gid in torch.unique(group_ids):
        members = group_ids == gid
        group = scores[members]
        if group.numel() < 2:
            raise ValueError("GRPO needs at least two responses per prompt (`grpo.group_size` >= 2)")
        if bool((group == group[0]).all()):
            continue  # a group that scored all alike has nothing to prefer: exactly 0, not 0/0
        centred = group - group.mean()
        adv[members] = centred / (group.std() + eps) if scale else centred
    return _masked(adv.to(torch.float32).unsqueeze(1).expand(mask.shape), mask)


# ---------------------------------------------------------------------------------------------
# Losses: each returns a *sum* over tokens; the caller divides by the mini-batch's token count
# ---------------------------------------------------------------------------------------------


@dataclass
class PolicyLossTerms:
    loss_sum: Tensor  # sum over tokens of max(-A r, -A clip(r)); divide by the mini-batch's tokens
    clipped_tokens: Tensor  # tokens where the clipped term was the larger one
    approx_kl_sum: Tensor  # sum of the k3 estimate of KL(pi_old || pi) (a diagnostic, no gradient)


def clipped_policy_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *, clip_ratio: float = 0.2
) -> PolicyLossTerms:
    """PPO's clipped surrogate summed over tokens: per token max(-A * r, -A * clip(r, 1-eps, 1+eps)),
    r = pi / pi_old. The per-token form, with decoupled and dual clipping, GSPO and CISPO, is
    :mod:`lightning_mem.rl.policy_losses` (what the recipe uses)."""
    from lightning_mem.rl.policy_losses import clipped_surrogate  # it builds on these statistics' masking

    terms = clipped_surrogate(logprobs, old_logprobs, advantages, mask, clip_low=clip_ratio, clip_high=clip_ratio)
    with torch.no_grad():
        clipped_tokens = masked_sum(terms.clipped.to(terms.loss.dtype), mask)
        approx_kl = masked_sum(torch.expm1(terms.log_ratio) - terms.log_ratio, mask)
    return PolicyLossTerms(masked_sum(terms.loss, mask), clipped_tokens, approx_kl)


@dataclass
class ValueLossTerms:
    loss_sum: Tensor  # sum over tokens of 0.5 * max((V - R)^2, (V_clip - R)^2)
    clipped_tokens: Tensor
    loss: Tensor | None = None  # [N, R] the per-token loss (0 on padding), for weighted aggregation


def clipped_value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *, clip_range: float | None = 0.2
) -> ValueLossTerms:
    """PPO's value loss: 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2) per token.

    Clipping keeps the critic near the values the advantages were computed with; ``clip_range``
    None gives the plain squared error.
    """
    values, old_values, returns = (_masked(x, mask) for x in (values, old_values, returns))
    unclipped = (values - returns).square()
    if clip_range is None:
        per_token = _masked(0.5 * unclipped, mask)
        return ValueLossTerms(per_token.sum(), torch.zeros((), device=values.device), per_token)
    v_clipped = old_values + torch.clamp(values - old_values, -clip_range, clip_range)
    clipped = (v_clipped - returns).square()
    with torch.no_grad():
        clipped_tokens = masked_sum((clipped > unclipped).to(values.dtype), mask)
    per_token = _masked(0.5 * torch.maximum(unclipped, clipped), mask)
    return ValueLossTerms(per_token.sum(), clipped_tokens, per_token)


# ---------------------------------------------------------------------------------------------
# KL coefficient
# ---------------------------------------------------------------------------------------------


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, coef: float) -> None:
        if coef < 0:
            raise ValueError(f"the KL coefficient must be >= 0, got {coef}")
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController(FixedKLController):
    """Ziegler et al. (2019): steer the coefficient so that the measured KL tracks ``target``.

    error = clip(kl / target - 1, -0.2, 0.2); coef *= 1 + error * n_steps / horizon. The clip
    bounds how fast one noisy batch can move it; ``horizon`` (in samples) sets the time constant.
    """

    def __init__(self, coef: float, target: float, horizon: int) -> None:
        super().__init__(coef)
        if target <= 0 or horizon <= 0:
            raise ValueError(f"adaptive KL needs target > 0 and horizon > 0, got {target}, {horizon}")
        self.target, self.horizon = float(target), int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        if not math.isfinite(current_kl):
            return
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
