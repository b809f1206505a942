"""Per-token policy losses: PPO's clipped surrogate with decoupled and dual clipping, GSPO and CISPO.

Each function returns the *per-token* loss ``[N, R]`` (0 on padding) and masks of which tokens a
clip touched; :mod:`lightning_mem.rl.loss_aggregation` turns it into one number, so every loss
works with every aggregation mode. Notation: ``r = pi_theta / pi_old`` per token,
``A`` the advantage, ``eps_low``/``eps_high`` the clip ranges, ``sg`` stop-gradient.

Ratios are exponentials of log-ratios clamped to ``[-MAX_LOG_RATIO, MAX_LOG_RATIO]`` first:
exp(89) overflows float32, and a stale or mismatched token can produce such a log-ratio; the
clamp (verl's ``torch.clamp(negative_approx_kl, -20, 20)``) keeps the loss and its gradient finite.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

from lightning_mem.rl.algorithms import _masked

PolicyLoss = Literal["vanilla", "gspo", "cispo"]
POLICY_LOSSES: tuple[str, ...] = get_args(PolicyLoss)

#: exp(20) ~ 4.9e8: far beyond any clip range, far below float32's overflow (exp(88.7)).
MAX_LOG_RATIO = 20.0


def safe_ratio(log_ratio: Tensor) -> Tensor:
    """exp of the log-ratio clamped to +-MAX_LOG_RATIO (finite, with a finite gradient)."""
    return torch.exp(log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))


@dataclass
class PolicyTerms:
    loss: Tensor  # [N, R] per-token loss, 0 on padding; aggregate it
    clipped: Tensor  # [N, R] bool: the clip changed this token's loss or weight (any side)
    clipped_low: Tensor  # [N, R] bool: the ratio was below 1 - eps_low and the clip acted on it
    clipped_high: Tensor  # [N, R] bool: the ratio was above 1 + eps_high and the clip acted on it
    dual_clipped: Tensor  # [N, R] bool: the dual clip's bound -A * c was the loss (A < 0)
    log_ratio: Tensor  # [N, R] log(pi / pi_old), detached, 0 on padding (for the approx-KL metric)


def clipped_surrogate(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float | None = None,
) -> PolicyTerms:
    """PPO's clipped surrogate (Schulman et al. 2017) with decoupled and dual clipping:

        l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))           (eps_low != eps_high: DAPO's
                                                                          "clip-higher", Yu et al. 2025)
        l = min(l, -A c)  where A < 0, if ``clip_c`` is set             (dual clip, Ye et al. 2020,
                                                                          "Mastering Complex Control...")

    The dual clip bounds the loss of a negative-advantage token whose ratio has run far above 1
    (without it, -A r grows without limit). Same as verl's ``compute_policy_loss_vanilla``
    (``clip_ratio_low``/``clip_ratio_high``/``clip_ratio_c``) and TRL's ``epsilon``/``epsilon_high``.
    """
    log_ratio = _masked(logprobs - old_logprobs, mask)  # selected before exp: padding cannot overflow
    advantages = _masked(advantages, mask)
    ratio = safe_ratio(log_ratio)
    unclipped = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped_loss)
    real = mask.bool()
    with torch.no_grad():
        clipped = (clipped_loss > unclipped) & real
        low, high = clipped & (ratio < 1.0 - clip_low), clipped & (ratio > 1.0 + clip_high)
    dual = torch.zeros_like(real)
    if clip_c is not None:
        bound = -advantages * clip_c
        with torch.no_grad():
            dual = (advantages < 0) & (loss > bound) & real
        loss = torch.where(advantages < 0, torch.minimum(loss, bound), loss)
    return PolicyTerms(_masked(loss, mask), clipped, low, high, dual, log_ratio.detach())


def sequence_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """GSPO's per-sequence log importance ratio, the length-normalised sum
    ``log s_i = (1/|o_i|) sum_t (log pi_theta - log pi_old)`` ([N]; 0 for an empty row)."""
    m = mask.float()
    return _masked(logprobs - old_logprobs, mask).sum(dim=1) / m.sum(dim=1).clamp(min=1)


def gspo_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *, clip_low: float, clip_high: float
) -> PolicyTerms:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"), token form "GSPO-token":

        s_i   = exp((1/|o_i|) sum_t log(pi_theta / pi_old))             (sequence ratio, geometric mean)
        s_i,t = sg[s_i] * pi_theta(o_i,t) / sg[pi_theta(o_i,t)]          (same value; d/dtheta per token)
        l     = max(-A s_i,t, -A clip(s_i,t, 1 - eps_low, 1 + eps_high))

    Every token of a sequence shares the clip decision, so a whole response is kept or cut. With
    ``seq-mean-token-mean`` aggregation and one advantage per response this is the paper's
    objective. The paper's clip ranges are tiny (3e-4 / 4e-4) because s_i is a per-token geometric
    mean. Same as verl's ``compute_policy_loss_gspo`` and TRL's ``importance_sampling_level: sequence``.
    """
    seq = sequence_log_ratio(logprobs, old_logprobs, mask)
    # log s_i,t: the value is log s_i, the gradient that of log pi_theta(o_i,t) (added last, as verl does,
    # so the detached terms cancel exactly in float).
    token_logprobs = _masked(logprobs, mask)
    log_ratio = token_logprobs - token_logprobs.detach() + seq.detach().unsqueeze(1)
    ratio = safe_ratio(log_ratio)
    advantages = _masked(advantages, mask)
    unclipped = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped_loss)
    real = mask.bool()
    with torch.no_grad():
        clipped = (clipped_loss > unclipped) & real
        low, high = clipped & (ratio < 1.0 - clip_low), clipped & (ratio > 1.0 + clip_high)
    token_log_ratio = _masked(logprobs - old_logprobs, mask).detach()
    return PolicyTerms(_masked(loss, mask), clipped, low, high, torch.zeros_like(real), token_log_ratio)


def cispo_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *, clip_low: float, clip_high: float
) -> PolicyTerms:
    """CISPO (MiniMax 2025, "MiniMax-M1", eq. 4-5): clip the importance *weight*, not the update:

        l = -sg[clip(r, 1 - eps_low, 1 + eps_high)] * A * log pi_theta

    The gradient is the REINFORCE one, reweighted; no token loses its gradient to the clip (PPO
    zeroes it where the clipped branch wins). MiniMax set no lower bound (a large ``eps_low``) and
    tuned only ``eps_high``. Same as verl's ``compute_policy_loss_cispo`` and TRL's
    ``loss_type: cispo`` (which caps the ratio at ``epsilon_high`` directly).
    """
    log_ratio = _masked(logprobs - old_logprobs, mask)
    ratio = safe_ratio(log_ratio).detach()
    weight = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = -weight * _masked(advantages, mask) * _masked(logprobs, mask)
    real = mask.bool()
    low, high = (ratio < 1.0 - clip_low) & real, (ratio > 1.0 + clip_high) & real
    return PolicyTerms(_masked(loss, mask), low | high, low, high, torch.zeros_like(real), log_ratio.detach())


def policy_loss(
    kind: str,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    clip_c: float | None = None,
) -> PolicyTerms:
    """The per-token loss of ``kind`` (``vanilla`` | ``gspo`` | ``cispo``)."""
    if kind == "vanilla":
        return clipped_surrogate(logprobs, old_logprobs, advantages, mask, clip_low=clip_low, clip_high=clip_high,
                                 clip_c=clip_c)
    if clip_c is not None:
        raise ValueError(f"the dual clip (clip_c) is a term of the vanilla surrogate, not of {kind!r}")
    if kind == "gspo":
        return gspo_loss(logprobs, old_logprobs, advantages, mask, clip_low=clip_low, clip_high=clip_high)
    if kind == "cispo":
        return cispo_loss(logprobs, old_logprobs, advantages, mask, clip_low=clip_low, clip_high=clip_high)
    raise ValueError(f"unknown policy loss {kind!r}; choose one of {POLICY_LOSSES}")
