"""Correction for the rollout engine's drift: truncated or masked importance sampling (TIS / MIS).

An engine with its own weights and kernels (vLLM, bf16 KV cache) samples from ``pi_engine``,
which is not quite the trainer's ``pi_old`` (TRL #4772, verl #2996: the gap grows with length and
breaks long runs). The PPO ratio is taken against ``pi_old``, so the samples need one more
importance weight, ``w = pi_old / pi_engine``, computed from the engine's log-probs of the sampled
tokens (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training";
Liu et al. 2025, "When Speed Kills Stability" for the masked and sequence-level variants):

=========== ========== ===========================================================================
mode        level      weight on each token's loss (``d_t = log pi_old - log pi_engine``)
=========== ========== ===========================================================================
``tis``     ``token``    ``min(exp(d_t), C)``
``tis``     ``sequence`` ``min(exp(sum_t d_t), C)``, the same for every token of the response
``mis``     ``token``    ``1`` if ``lower <= exp(d_t) <= upper`` else ``0`` (the token is dropped)
``mis``     ``sequence`` ``1`` if ``lower <= exp(sum_t d_t) <= upper`` else ``0`` (the response is)
=========== ========== ===========================================================================

TIS keeps every sample with a bounded weight (biased, low variance); MIS drops the samples the
engine got most wrong and leaves the rest unweighted. Weights carry no gradient. Everything is
compared in log space, so a sequence whose summed log-ratio is 1e4 gives no inf.

Names elsewhere: verl ``algorithm.rollout_correction`` (``rollout_is: token|sequence`` with
``rollout_is_threshold``; ``rollout_rs`` for rejection/masking with ``rollout_rs_threshold`` and
``..._lower``); TRL ``vllm_importance_sampling_correction`` with
``vllm_importance_sampling_mode: token_truncate | token_mask | sequence_truncate | sequence_mask``
and ``vllm_importance_sampling_cap``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

from lightning_mem.rl.masking import masked as _masked

CorrectionMode = Literal["none", "tis", "mis"]
CORRECTION_MODES: tuple[str, ...] = get_args(CorrectionMode)
CorrectionLevel = Literal["token", "sequence"]
CORRECTION_LEVELS: tuple[str, ...] = get_args(CorrectionLevel)


@dataclass
class CorrectionWeights:
    weights: Tensor  # [N, R] the factor on each token's loss (0 on padding and on masked tokens)
    affected: Tensor  # [N, R] bool: tokens the cap truncated (TIS) or the bounds masked (MIS)


def correction_weights(
    old_logprobs: Tensor,
    engine_logprobs: Tensor,
    mask: Tensor,
    *,
    mode: str,
    level: str = "token",
    upper: float = 2.0,
    lower: float | None = None,
) -> CorrectionWeights:
    """The importance weights of the table in the module docstring (detached)."""
    if mode not in ("tis", "mis"):
        raise ValueError(f"unknown correction mode {mode!r}; choose 'tis' or 'mis'")
    if level not in CORRECTION_LEVELS:
        raise ValueError(f"unknown correction level {level!r}; choose one of {CORRECTION_LEVELS}")
    real = mask.bool()
    with torch.no_grad():
        d = _masked(old_logprobs.detach() - engine_logprobs.detach(), mask).to(torch.float64)
        log_w = d if level == "token" else d.sum(dim=1, keepdim=True).expand_as(d)
        log_upper = math.log(upper)
        if mode == "tis":
            affected = (log_w > log_upper) & real
            weights = torch.exp(log_w.clamp(max=log_upper))
        else:
            log_lower = -math.inf if not lower else math.log(lower)
            affected = ((log_w > log_upper) | (log_w < log_lower)) & real
            weights = (~affected).to(torch.float64)
        return CorrectionWeights(_masked(weights, mask).to(old_logprobs.dtype), affected)


def mismatch_kl(old_logprobs: Tensor, engine_logprobs: Tensor, mask: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(pi_engine || pi_old) from the engine's samples, ``[N, R]``:
    ``(rho - 1) - log rho`` with ``rho = pi_old / pi_engine`` (>= 0, 0 where they agree). Its mean
    is the drift to watch (verl logs the same as ``rollout_corr/kl``)."""
    d = _masked((old_logprobs - engine_logprobs).detach(), mask).clamp(-20.0, 20.0)
    return _masked(torch.expm1(d) - d, mask)
