"""How per-token losses become one number: the four aggregation modes, split into a numerator each
micro-batch can compute alone and a denominator counted once over the whole mini-batch.

With ``l[i, t]`` the per-token loss, ``m[i, t]`` the loss mask (1 on a response token that trains),
``|o_i| = sum_t m[i, t]`` a response's length, ``B`` the number of sequences with at least one
such token and ``L`` a fixed token horizon (the generation's ``max_new_tokens``):

=========================== ============================================== ===========================
mode                        loss                                           also called
=========================== ============================================== ===========================
``token-mean``              sum_i sum_t l / sum_i |o_i|                    verl ``token-mean``; TRL
                                                                           ``loss_type: dapo``/``bnpo``
``seq-mean-token-sum``      (1/B) sum_i sum_t l                            verl ``seq-mean-token-sum``
``seq-mean-token-mean``     (1/B) sum_i (1/|o_i|) sum_t l                  verl ``seq-mean-token-mean``;
                                                                           TRL ``grpo``; GRPO's paper
``seq-mean-token-sum-norm`` (1/(B L)) sum_i sum_t l                        verl ``seq-mean-token-sum-norm``;
                                                                           TRL ``dr_grpo`` (Liu et al. 2025)
=========================== ============================================== ===========================

Sources: verl ``verl/trainer/ppo/core_algos.py::agg_loss``; TRL ``GRPOTrainer._compute_loss``
(``loss_type``); DAPO (Yu et al. 2025, token-level loss); Dr. GRPO (Liu et al. 2025,
"Understanding R1-Zero-Like Training", a constant normaliser instead of ``|o_i|``).

Two deliberate differences from verl's ``agg_loss``: ``seq-mean-token-sum-norm`` divides by
``B * L`` (TRL's ``dr_grpo``; verl divides by ``L`` alone and by the padded width, which changes
with every micro-batch), and the counts are those of the whole mini-batch on all ranks, so that
splitting it into micro-batches or over ranks never changes the gradient. A fully masked row
(a filtered sample) contributes nothing and is not counted in ``B``.

The sequence policy losses (GSPO, GMPO) put one loss per response on each of its tokens; verl
aggregates them ``seq-mean-token-mean`` whatever its ``loss_agg_mode``, and so does the recipe
unless ``model.ppo.loss_agg_mode`` says otherwise (:attr:`lightning_mem.rl.config.PPOConfig.agg_mode`).
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAggMode)


def token_weights(mask: Tensor, mode: str) -> Tensor:
    """Each token's weight in the numerator: ``m[i, t]``, or ``m[i, t] / |o_i|`` for
    ``seq-mean-token-mean``. Multiply the per-token loss by it and sum (a micro-batch's share)."""
    mask = mask.float()
    if mode == "seq-mean-token-mean":
        return mask / mask.sum(dim=1, keepdim=True).clamp(min=1)
    if mode in LOSS_AGG_MODES:
        return mask
    raise ValueError(f"unknown loss aggregation mode {mode!r}; choose one of {LOSS_AGG_MODES}")


def weighted_sum(values: Tensor, weights: Tensor) -> Tensor:
    """sum(values * weights) over the tokens with a weight; a non-finite value where the weight is
    0 (padding, a filtered sample) gives 0 and no NaN gradient."""
    return torch.where(weights > 0, values * weights, torch.zeros((), dtype=values.dtype, device=values.device)).sum()


def counts(mask: Tensor) -> Tensor:
    """``[tokens, sequences]`` of a (micro- or mini-) batch, as float64: sum them over ranks, then
    pass them to :func:`denominator`."""
    mask = mask.to(torch.float64)
    return torch.stack([mask.sum(), (mask.sum(dim=1) > 0).sum().to(torch.float64)])


def denominator(mode: str, tokens: Tensor | float, sequences: Tensor | float, horizon: int | None = None) -> Tensor:
    """What the summed numerator is divided by: tokens, sequences, or sequences x ``horizon``;
    at least 1 (a mini-batch whose every sample was filtered gives a zero loss, not 0/0)."""
    tokens, sequences = torch.as_tensor(tokens, dtype=torch.float64), torch.as_tensor(sequences, dtype=torch.float64)
    if mode == "token-mean":
        value = tokens
    elif mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
        value = sequences
    elif mode == "seq-mean-token-sum-norm":
        if horizon is None or horizon < 1:
            raise ValueError("`seq-mean-token-sum-norm` needs the constant token horizon L (max_new_tokens) >= 1")
        value = sequences * horizon
    else:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; choose one of {LOSS_AGG_MODES}")
    return value.clamp(min=1)


def aggregate(loss: Tensor, mask: Tensor, mode: str, horizon: int | None = None) -> Tensor:
    """One batch's aggregated loss (the table in the module docstring), in a single process."""
    numerator = weighted_sum(loss, token_weights(mask, mode))
    tokens, sequences = counts(mask)
    return numerator / denominator(mode, tokens, sequences, horizon).to(loss.dtype)
