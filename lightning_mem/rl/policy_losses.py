"""Per-token policy losses: PPO's clipped surrogate with decoupled and dual clipping, GSPO, CISPO,
Clip-Cov, KL-Cov and GMPO.

Each function returns the *per-token* loss ``[N, R]`` (0 on padding) and masks of which tokens a
clip touched; :mod:`lightning_mem.rl.loss_aggregation` turns it into one number, so every loss
works with every aggregation mode. Notation: ``r = pi_theta / pi_old`` per token,
``A`` the advantage, ``eps_low``/``eps_high`` the clip ranges, ``sg`` stop-gradient.

Ratios are exponentials of log-ratios clamped to ``[-MAX_LOG_RATIO, MAX_LOG_RATIO]`` first:
exp(89) overflows float32, and a stale or mismatched token can produce such a log-ratio; the
clamp (verl's ``torch.clamp(negative_approx_kl, -20, 20)``) keeps the loss and its gradient finite.
GSPO clamps its sequence log-ratio at ``GSPO_MAX_LOG_RATIO`` from above only, as verl does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

from lightning_mem.rl.masking import masked as _masked

PolicyLoss = Literal["vanilla", "gspo", "cispo", "clip_cov", "kl_cov", "geo_mean"]
POLICY_LOSSES: tuple[str, ...] = get_args(PolicyLoss)
#: The losses whose objective is one number per response (a ratio of the whole sequence): their
#: papers, and verl, average them over responses (``seq-mean-token-mean``), not over tokens.
SEQUENCE_LOSSES = ("gspo", "geo_mean")

#: exp(20) ~ 4.9e8: far beyond any clip range, far below float32's overflow (exp(88.7)).
MAX_LOG_RATIO = 20.0
#: GSPO's bound on log s_i,t, from above only (verl's ``torch.clamp(log_seq_importance_ratio, max=10.0)``):
#: a sequence ratio past e^10 ~ 22,026 has a loss of -A e^10 and no gradient (the clamp cuts it).
#: Below, exp(very negative) is 0, not an overflow, so no lower bound is needed.
GSPO_MAX_LOG_RATIO = 10.0


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
    loss, clipped, low, high = _clipped_surrogate_terms(ratio, advantages, mask, clip_low, clip_high)
    real = mask.bool()
    dual = torch.zeros_like(real)
    if clip_c is not None:
        bound = -advantages * clip_c
        with torch.no_grad():
            dual = (advantages < 0) & (loss > bound) & real
        loss = torch.where(advantages < 0, torch.minimum(loss, bound), loss)
    return PolicyTerms(_masked(loss, mask), clipped, low, high, dual, log_ratio.detach())


def _clipped_surrogate_terms(ratio: Tensor, advantages: Tensor, mask: Tensor, clip_low: float,
                             clip_high: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """PPO's pessimistic clipped loss ``max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))`` and which
    real tokens the clip decided (all, below the range, above it): shared by token and sequence ratios."""
    unclipped = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped_loss)
    with torch.no_grad():
        clipped = (clipped_loss > unclipped) & mask.bool()
        low, high = clipped & (ratio < 1.0 - clip_low), clipped & (ratio > 1.0 + clip_high)
    return loss, clipped, low, high


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
    objective, and what verl's ``compute_policy_loss_gspo`` always computes (it ignores
    ``loss_agg_mode``); the recipe makes it the default under ``policy_loss: gspo`` and warns when a
    config chooses another mode (:class:`~lightning_mem.rl.config.PPOConfig`). The paper's clip
    ranges are tiny (3e-4 / 4e-4) because s_i is a per-token geometric mean.

    ``log s_i,t`` is clamped at ``GSPO_MAX_LOG_RATIO`` (10) from above, as verl clamps it: a
    negative-advantage response whose ratio ran past e^10 has loss ``-A e^10`` and no gradient
    (without the clamp each token's loss would pass a gradient of ``-A s_i``, e^12 ~ 162,755 at
    log s = 12 and A = -1; a positive advantage is clipped there anyway). TRL's ``importance_sampling_level: sequence``
    has no such clamp.
    """
    seq = sequence_log_ratio(logprobs, old_logprobs, mask)
    # log s_i,t: the value is log s_i, the gradient that of log pi_theta(o_i,t) (added last, as verl does,
    # so the detached terms cancel exactly in float).
    token_logprobs = _masked(logprobs, mask)
    log_ratio = token_logprobs - token_logprobs.detach() + seq.detach().unsqueeze(1)
    ratio = torch.exp(log_ratio.clamp(max=GSPO_MAX_LOG_RATIO))
    loss, clipped, low, high = _clipped_surrogate_terms(ratio, _masked(advantages, mask), mask, clip_low, clip_high)
    real = mask.bool()
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


# ---------------------------------------------------------------------------------------------
# Covariance-based entropy control (Cui et al. 2025) and GMPO (Zhao et al. 2025)
# ---------------------------------------------------------------------------------------------


def token_covariance(logprobs: Tensor, advantages: Tensor, mask: Tensor) -> Tensor:
    """Each real token's term of the covariance between log-probability and advantage over the
    batch's tokens (Cui et al. 2025, sec. 5):

        cov_t = (A_t - mean_s A_s) * (log pi_t - mean_s log pi_s)      (means over real tokens)

    Detached (it only selects tokens); 0 on padding. Tokens with a large positive term are those
    whose update lowers the policy's entropy the most (a confident token pushed up, or an unlikely
    one pushed down)."""
    real = mask.bool()
    count = real.sum().clamp(min=1)
    lp, adv = _masked(logprobs.detach(), mask), _masked(advantages.detach(), mask)
    cov = (adv - adv.sum() / count) * (lp - lp.sum() / count)
    return _masked(cov, mask)


def clip_cov_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *, clip_low: float, clip_high: float,
    ratio: float = 2e-4, lower: float = 1.0, upper: float = 5.0, generator: torch.Generator | None = None,
) -> PolicyTerms:
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning
    Language Models", arXiv 2505.22617): PPO's clipped surrogate, with a few high-covariance tokens taken
    out of the update:

        l_t = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)) * (1 - c_t)
        c_t = 1 for k = max(1, floor(ratio * T)) tokens drawn at random among the real tokens that
              PPO's clip left alone and whose cov_t (:func:`token_covariance`) lies in (lower, upper)

    ``T`` is the number of real tokens passed in. A chosen token's loss is 0: no value and no
    gradient (verl's ``compute_policy_loss_clip_cov`` multiplies it by 0; the paper says "detach").
    Defaults are verl's (``clip_cov_ratio`` 2e-4, ``clip_cov_lb`` 1, ``clip_cov_ub`` 5). The covariance
    means, ``T`` and the draw are over the tokens of this call, as in verl (per micro-batch in the
    recipe), so the split into micro-batches changes which tokens are chosen; ``clipped`` marks them
    too. The draw is ``torch.randperm`` on ``generator`` (the default CPU generator: in the recipe,
    the seeded sampling stream).
    """
    log_ratio = _masked(logprobs - old_logprobs, mask)
    advantages = _masked(advantages, mask)
    loss, clipped, low, high = _clipped_surrogate_terms(safe_ratio(log_ratio), advantages, mask, clip_low, clip_high)
    real = mask.bool()
    with torch.no_grad():
        cov = token_covariance(logprobs, advantages, mask)
        candidates = torch.nonzero((real & ~clipped & (cov > lower) & (cov < upper)).flatten()).flatten()
        k = min(max(int(ratio * int(real.sum())), 1), candidates.numel())
        chosen = torch.zeros(real.numel(), dtype=torch.bool, device=real.device)
        if k:
            pick = torch.randperm(candidates.numel(), generator=generator)[:k].to(candidates.device)
            chosen[candidates[pick]] = True
        chosen = chosen.view_as(real)
    loss = torch.where(chosen, torch.zeros_like(loss), loss)
    return PolicyTerms(_masked(loss, mask), clipped | chosen, low, high, torch.zeros_like(real), log_ratio.detach())


def kl_cov_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *, ratio: float = 2e-4, coef: float = 0.1,
) -> PolicyTerms:
    """KL-Cov (Cui et al. 2025, as :func:`clip_cov_loss`): the unclipped surrogate, with a KL penalty on the tokens
    of largest covariance:

        l_t = -A r + coef * |log r| * [t among the top-k cov_t],   k = max(1, floor(ratio * T))

    No PPO clip at all (verl's ``compute_policy_loss_kl_cov`` has none either): the penalty on the
    few tokens that drive entropy down is the only brake. Defaults are verl's (``kl_cov_ratio``
    2e-4, ``ppo_kl_coef`` 0.1). As in verl, ``T``, the covariance means and the top-k are over the
    tokens of this call (per micro-batch in the recipe). ``clipped`` marks the penalised tokens.
    """
    log_ratio = _masked(logprobs - old_logprobs, mask)
    advantages = _masked(advantages, mask)
    real = mask.bool()
    loss = -advantages * safe_ratio(log_ratio)
    with torch.no_grad():
        n = int(real.sum())
        chosen = torch.zeros(real.numel(), dtype=torch.bool, device=real.device)
        if n:
            cov = token_covariance(logprobs, advantages, mask).flatten()
            cov = torch.where(real.flatten(), cov, torch.full_like(cov, -torch.inf))
            chosen[torch.topk(cov, min(max(int(ratio * n), 1), n)).indices] = True
        chosen = chosen.view_as(real)
    loss = loss + torch.where(chosen, coef * log_ratio.abs(), torch.zeros_like(loss))
    none = torch.zeros_like(real)
    return PolicyTerms(_masked(loss, mask), chosen, none, none, none, log_ratio.detach())


def geo_mean_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *, clip_low: float, clip_high: float
) -> PolicyTerms:
    """GMPO (Zhao et al. 2025, "Geometric-Mean Policy Optimization", arXiv 2507.20673): one ratio per response,
    the geometric mean of its tokens' ratios, each token's clipped first, in log space:

        d_t  = log(pi_theta / pi_old)
        d~_t = sgn(A) min(sgn(A) d_t, sgn(A) clip(d_t, -eps_low, eps_high))   (PPO's pessimism per sign)
        l_i  = -A_i exp((1/|o_i|) sum_t d~_t),   A_i = (1/|o_i|) sum_t A_t

    The clip range is on the *log* ratio (the paper's (e^-0.4, e^0.4) is ``eps = 0.4``), and a
    clipped token passes no gradient. Every token carries its response's ``l_i``, so
    ``seq-mean-token-mean`` aggregation gives the mean over responses, the paper's and verl's
    objective (``compute_policy_loss_geo_mean``, whose ``loss_agg_mode`` is unused); the recipe makes
    it the default under ``policy_loss: geo_mean``. One difference from verl: the mean log-ratio is
    clamped to +-``MAX_LOG_RATIO`` before the exp (verl has the clamp commented out, and a
    negative-advantage response with a huge ratio overflows there).
    """
    log_ratio = _masked(logprobs - old_logprobs, mask)
    advantages = _masked(advantages, mask)
    m = mask.float()
    length = m.sum(dim=1).clamp(min=1)
    sign = torch.sign(advantages)
    clamped = log_ratio.clamp(-clip_low, clip_high)
    kept = sign * torch.minimum(sign * log_ratio, sign * clamped)
    seq_ratio = safe_ratio(_masked(kept, mask).sum(dim=1) / length)
    seq_advantage = advantages.sum(dim=1) / length
    loss = (-seq_advantage * seq_ratio).unsqueeze(1).expand(mask.shape)
    real = mask.bool()
    with torch.no_grad():
        high = real & (advantages > 0) & (log_ratio > clip_high)
        low = real & (advantages < 0) & (log_ratio < -clip_low)
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
    **options: float,
) -> PolicyTerms:
    """The per-token loss of ``kind`` (one of ``POLICY_LOSSES``); ``options`` are the covariance
    losses' own settings (``ratio``, ``lower``, ``upper`` for ``clip_cov``; ``ratio``, ``coef`` for
    ``kl_cov``)."""
    if kind == "vanilla":
        return clipped_surrogate(logprobs, old_logprobs, advantages, mask, clip_low=clip_low, clip_high=clip_high,
                                 clip_c=clip_c)
    if clip_c is not None:
        raise ValueError(f"the dual clip (clip_c) is a term of the vanilla surrogate, not of {kind!r}")
    if kind == "gspo":
        return gspo_loss(logprobs, old_logprobs, advantages, mask, clip_low=clip_low, clip_high=clip_high)
    if kind == "cispo":
        return cispo_loss(logprobs, old_logprobs, advantages, mask, clip_low=clip_low, clip_high=clip_high)
    if kind == "clip_cov":
        return clip_cov_loss(logprobs, old_logprobs, advantages, mask, clip_low=clip_low, clip_high=clip_high, **options)
    if kind == "kl_cov":
        return kl_cov_loss(logprobs, old_logprobs, advantages, mask, **options)
    if kind == "geo_mean":
        return geo_mean_loss(logprobs, old_logprobs, advantages, mask, clip_low=clip_low, clip_high=clip_high)
    raise ValueError(f"unknown policy loss {kind!r}; choose one of {POLICY_LOSSES}")
