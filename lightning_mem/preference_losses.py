"""Preference losses over summed sequence log-probs: DPO and its family (TRL DPOTrainer's menu),
SimPO and ORPO, alone or several weighted together (MPO).

A recipe hands over, for each side of the pairs, the summed completion-token log-probs of each
sequence and its completion-token count (:class:`SequenceLogps`), for the policy and, where a loss
needs one, the reference. Notation (one pair): ``S = sum log pi(y|x)`` over the completion tokens,
``n`` their count, ``m = S / n`` the per-token mean, ``Dc = S_pi(c) - S_ref(c)`` and ``Dr`` the same
for rejected, ``D = Dc - Dr``, ``eps`` the label smoothing, ``sigma`` the logistic function. Every
loss is per pair (:attr:`PreferenceLossOutput.pair_losses`) so that the recipe can average over the
optimizer step's pairs; the NLL on chosen (``sft``, ORPO's NLL term) is a token mean the recipe
computes over the step, so only its coefficient comes back (:attr:`PreferenceLossOutput.nll_weight`).

The formulas, with TRL's and the papers', and every convention: ``docs/dpo.md``, "The objectives".
Computed in float32 whatever the log-probs' dtype; the reference's log-probs are detached.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from jsonargparse.typing import NonNegativeFloat, PositiveFloat, restricted_number_type
from torch import Tensor

from lightning_mem.settings import SettingError, check_fields

#: ``[0, 0.5)``: a probability that a preference label is flipped (cDPO, robust DPO, EXO's epsilon).
LabelSmoothing = restricted_number_type(
    "LabelSmoothing", float, [(">=", 0), ("<", 0.5)], docstring="float restricted to 0 <= v < 0.5"
)

#: Every loss type, in the order of the docs' table.
LOSS_TYPES: tuple[str, ...] = (
    "sigmoid", "sigmoid_norm", "hinge", "ipo", "robust", "exo_pair", "bco_pair", "nca_pair", "sppo_hard",
    "apo_zero", "apo_down", "discopop", "aot", "aot_unpaired", "sft", "simpo", "orpo",
)
#: The losses that read the policy's log-probs only.
REFERENCE_FREE: tuple[str, ...] = ("sft", "simpo", "orpo")
#: The losses that read ``label_smoothing``.
SMOOTHED: tuple[str, ...] = ("sigmoid", "sigmoid_norm", "robust", "exo_pair", "aot", "aot_unpaired", "simpo")
#: ORPO's log-odds need log(1 - p) of a mean log-prob; a mean of exactly 0 (every token certain)
#: would give log(0). Means are capped just below 0 there (no gradient through the cap).
MAX_MEAN_LOGP = -1e-6


@dataclass
class PreferenceLossSettings:
    """The objective (YAML ``model.dpo`` of ``recipes.dpo``); validated on construction.

    Args:
        loss_type: one of :data:`LOSS_TYPES`, or several, weighted together (MPO).
        loss_weights: one weight per entry of ``loss_type`` (None: 1.0 each).
        beta: the inverse temperature on the log-ratios (IPO's tau, SimPO's beta).
        label_smoothing: the probability that a label is flipped: cDPO's smoothing in ``sigmoid``,
            ``sigmoid_norm``, ``aot``, ``aot_unpaired`` and ``simpo``; robust DPO's and EXO's
            epsilon. Refused where no listed loss reads it.
        gamma: SimPO's target margin (TRL's ``simpo_gamma``), on the beta-scaled mean log-probs.
        orpo_lambda: ORPO's lambda, the weight of the odds-ratio term (TRL ORPOConfig's ``beta``).
        discopop_tau: DiscoPOP's temperature of the modulation.
    """

    loss_type: str | list[str] = "sigmoid"
    loss_weights: list[float] | None = None
    beta: PositiveFloat = 0.1
    label_smoothing: LabelSmoothing = 0.0
    gamma: NonNegativeFloat = 0.5
    orpo_lambda: PositiveFloat = 0.1
    discopop_tau: PositiveFloat = 0.05

    def __post_init__(self) -> None:
        check_fields(self)
        if not isinstance(self.loss_type, (str, list, tuple)):
            raise SettingError("loss_type", f" must be a name or a list of names, got {self.loss_type!r}")
        types = self.loss_types
        unknown = [name for name in types if name not in LOSS_TYPES]
        if not types or unknown:
            got = f"unknown {unknown[0]!r}" if unknown else "an empty list"
            raise SettingError("loss_type", f" must be one of {', '.join(LOSS_TYPES)} (or a list of them), got {got}")
        twice = next((name for name in types if types.count(name) > 1), None)
        if twice is not None:
            raise SettingError("loss_type", f" lists {twice!r} twice; give it one entry and one weight in `loss_weights`",
                               siblings=("loss_weights",))
        if self.loss_weights is not None:
            self._check_weights(types)
        if "exo_pair" in types and self.label_smoothing == 0:
            raise SettingError("label_smoothing", " must be above 0 with `loss_type` exo_pair (EXO's epsilon; its"
                               " paper suggests 1e-3)", siblings=("loss_type",))
        if self.label_smoothing > 0 and not any(name in SMOOTHED for name in types):
            raise SettingError("label_smoothing", f" is read by {', '.join(SMOOTHED)}; `loss_type` {list(types)} reads"
                               " none of them (set it to 0)", siblings=("loss_type",))

    def _check_weights(self, types: tuple[str, ...]) -> None:
        weights = self.loss_weights
        if not isinstance(weights, (list, tuple)) or len(weights) != len(types):
            count = len(weights) if isinstance(weights, (list, tuple)) else type(weights).__name__
            raise SettingError("loss_weights", f" needs one weight per `loss_type` entry ({len(types)}), got {count}",
                               siblings=("loss_type",))
        for weight in weights:
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight < 0:
                raise SettingError("loss_weights", f" must be finite numbers >= 0, got {weight!r}")

    @property
    def loss_types(self) -> tuple[str, ...]:
        """``loss_type`` as a tuple of names."""
        return (self.loss_type,) if isinstance(self.loss_type, str) else tuple(self.loss_type)

    @property
    def weights(self) -> tuple[float, ...]:
        """One weight per loss type (1.0 each without ``loss_weights``)."""
        if self.loss_weights is None:
            return (1.0,) * len(self.loss_types)
        return tuple(float(w) for w in self.loss_weights)

    @property
    def needs_reference(self) -> bool:
        """False when every loss type is reference-free (``sft``, ``simpo``, ``orpo``)."""
        return any(name not in REFERENCE_FREE for name in self.loss_types)


@dataclass
class SequenceLogps:
    """One side of the pairs, one entry per pair.

    Args:
        sums: ``[B]`` the summed completion-token log-probs of each sequence.
        tokens: ``[B]`` the completion-token count of each sequence.
    """

    sums: Tensor
    tokens: Tensor


@dataclass
class PreferenceLossOutput:
    """What the recipe needs from one micro-batch of pairs.

    Args:
        pair_losses: ``[B]`` each pair's loss, every pairwise term weighted and summed; the recipe
            divides their sum by the pairs of the optimizer step.
        nll_weight: the coefficient of the token-mean NLL on the chosen completions (``sft``, ORPO's
            NLL term, times their weights); 0.0 without either.
        chosen_rewards, rejected_rewards: ``[B]`` detached implicit rewards: ``beta * (S_pi - S_ref)``
            wherever a reference is read; otherwise ``orpo_lambda * m`` when ``orpo`` is listed before
            ``simpo``, else ``beta * m`` (SimPO's, and ``sft`` alone).
    """

    pair_losses: Tensor
    nll_weight: float
    chosen_rewards: Tensor
    rejected_rewards: Tensor


class _Pairs(NamedTuple):
    """The float32 quantities the losses read (reference ones None without a reference)."""

    chosen: Tensor  # S_pi(c)
    rejected: Tensor  # S_pi(r)
    chosen_mean: Tensor  # m_pi(c)
    rejected_mean: Tensor  # m_pi(r)
    chosen_ratio: Tensor | None  # Dc
    rejected_ratio: Tensor | None  # Dr
    ref_chosen: Tensor | None  # S_ref(c), detached
    ref_rejected: Tensor | None
    chosen_tokens: Tensor  # n(c), float32, at least 1
    rejected_tokens: Tensor

    @property
    def delta(self) -> Tensor:
        return self.chosen_ratio - self.rejected_ratio


def _smoothed(logits: Tensor, eps: float) -> Tensor:
    """cDPO's ``-(1 - eps) log sigma(x) - eps log sigma(-x)``: the expected logistic loss when a
    label is flipped with probability eps (eps 0: DPO's ``-log sigma(x)``)."""
    loss = -F.logsigmoid(logits)
    return loss if eps == 0 else (1 - eps) * loss - eps * F.logsigmoid(-logits)


def _sigmoid(p: _Pairs, s: PreferenceLossSettings) -> Tensor:
    return _smoothed(s.beta * p.delta, s.label_smoothing)


def _mean_delta(p: _Pairs) -> Tensor:
    return p.chosen_ratio / p.chosen_tokens - p.rejected_ratio / p.rejected_tokens


def _sigmoid_norm(p: _Pairs, s: PreferenceLossSettings) -> Tensor:
    return _smoothed(s.beta * _mean_delta(p), s.label_smoothing)


def _hinge(p: _Pairs, s: PreferenceLossSettings) -> Tensor:
    return torch.relu(1 - s.beta * p.delta)


def _ipo(p: _Pairs, s: PreferenceLossSettings) -> Tensor:
    # Per-token means: with sums the square grows with the completions' length (TRL's reading of
    # the IPO paper, confirmed with its authors; OpenRLHF squares the sums).
    return (_mean_delta(p) - 1 / (2 * s.beta)) ** 2


def _robust(p: _Pairs, s: PreferenceLossSettings) -> Tensor:
    x, eps = s.beta * p.delta, s.label_smoothing
    return (-(1 - eps) * F.logsigmoid(x) + eps * F.logsigmoid(-x)) / (1 - 2 * eps)


def _exo_pair(p: _Pairs, s: PreferenceLossSettings) -> Tensor:
    # KL(q || target) over {chosen, rejected}, q = softmax of the beta-scaled log-ratios, target
    # (1 - eps, eps); written with logsigmoid so that neither side underflows to log 0.
    x, eps = s.beta * p.delta, s.label_smoothing
    return (torch.sigmoid(x) * (F.logsigmoid(x) - math.log1p(-eps))
            + torch.sigmoid(-x) * (F.logsigmoid(-x) - math.log(eps)))


def _bco_pair(p: _Pairs, s: PreferenceLossSettings) -> Tensor:
    # No reward shift (delta = 0), as TRL since its DPO refactor (#3906): a running or batch mean
    # of the rewards would make a pair's loss depend on the micro-batch split and on history.
    return -F.logsigmoid(s.beta * p.chosen_ratio) - F.logsigmoid(-s.beta * p.rejected_ratio)


def _nca_pair(p: _Pairs, s: PreferenceLossSettings) -> Tensor:
    rc, rr = s.beta * p.chosen_ratio, s.beta * p.rejected_ratio
    return -F.logsigmoid(rc) - 0.5 * F.logsigmoid(-rc) - 0.5 * F.logsigmoid(-rr)


def _sppo_hard(p: _Pairs, s: PreferenceLossSettings) -> Tensor:
    half = 0.5 / s.beta
    return (p.chosen_ratio - half) ** 2 + (p.rejected_ratio + half) ** 2


def _apo_zero(p: _Pairs, s: PreferenceLossSettings) -> Tensor:
    return 1 - torch.sigmoid(s.beta * p.chosen_ratio) + torch.sigmoid(s.beta * p.rejected_ratio)


def _apo_down(p: _Pairs, s: PreferenceLossSettings) -> Tensor:
    return torch.sigmoid(s.beta * p.chosen_ratio) + 1 - torch.sigmoid(s.beta * p.delta)


def _discopop(p: _Pairs, s: PreferenceLossSettings) -> Tensor:
    x = s.beta * p.delta
    # exp(-x) * sigma(x / tau) as one exponential: the product TRL writes is inf * 0 = NaN once
    # exp(-x) overflows (x < -88), where the modulation has long since gone to 0.
    exponential = torch.exp(F.logsigmoid(x / s.discopop_tau) - x)
    return -F.logsigmoid(x) * torch.sigmoid(-x / s.discopop_tau) + exponential


def _aot(p: _Pairs, s: PreferenceLossSettings) -> Tensor:
    # Sorted over the micro-batch: the i-th smallest policy margin against the i-th smallest
    # reference margin (stochastic dominance of quantiles), not pair against its own reference.
    policy, _ = torch.sort(p.chosen - p.rejected)
    reference, _ = torch.sort(p.ref_chosen - p.ref_rejected)
    return _smoothed(s.beta * (policy - reference), s.label_smoothing)


def _aot_unpaired(p: _Pairs, s: PreferenceLossSettings) -> Tensor:
    chosen, _ = torch.sort(p.chosen_ratio)
    rejected, _ = torch.sort(p.rejected_ratio)
    return _smoothed(s.beta * (chosen - rejected), s.label_smoothing)


def _simpo(p: _Pairs, s: PreferenceLossSettings) -> Tensor:
    return _smoothed(s.beta * (p.chosen_mean - p.rejected_mean) - s.gamma, s.label_smoothing)


def _log1mexp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x < 0, accurate on both sides of -ln 2 (Maechler's split)."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def _orpo(p: _Pairs, s: PreferenceLossSettings) -> Tensor:
    # log odds(y) = m - log(1 - exp(m)) on the per-token mean m; the odds ratio's log is their
    # difference. NLL is the other half of ORPO: PreferenceLossOutput.nll_weight.
    chosen, rejected = p.chosen_mean.clamp(max=MAX_MEAN_LOGP), p.rejected_mean.clamp(max=MAX_MEAN_LOGP)
    log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
    return -s.orpo_lambda * F.logsigmoid(log_odds)


_LOSSES: dict[str, Callable[[_Pairs, PreferenceLossSettings], Tensor]] = {
    "sigmoid": _sigmoid, "sigmoid_norm": _sigmoid_norm, "hinge": _hinge, "ipo": _ipo, "robust": _robust,
    "exo_pair": _exo_pair, "bco_pair": _bco_pair, "nca_pair": _nca_pair, "sppo_hard": _sppo_hard,
    "apo_zero": _apo_zero, "apo_down": _apo_down, "discopop": _discopop, "aot": _aot,
    "aot_unpaired": _aot_unpaired, "simpo": _simpo, "orpo": _orpo,
}
#: The coefficient each listed loss puts on the token-mean NLL of chosen (times its weight).
_NLL = {"sft": 1.0, "orpo": 1.0}


def _pairs(settings: PreferenceLossSettings, policy_chosen: SequenceLogps, policy_rejected: SequenceLogps,
           reference_chosen: SequenceLogps | None, reference_rejected: SequenceLogps | None) -> _Pairs:
    sides = [policy_chosen, policy_rejected, reference_chosen, reference_rejected]
    shapes = {tuple(side.sums.shape) for side in sides if side is not None}
    shapes |= {tuple(side.tokens.shape) for side in sides if side is not None}
    if len(shapes) != 1 or len(next(iter(shapes))) != 1:
        raise ValueError(f"every side's sums and tokens must be one [B] shape, got {sorted(shapes)}")
    chosen_tokens = policy_chosen.tokens.clamp(min=1).to(torch.float32)
    rejected_tokens = policy_rejected.tokens.clamp(min=1).to(torch.float32)
    chosen, rejected = policy_chosen.sums.float(), policy_rejected.sums.float()
    ref_chosen = ref_rejected = chosen_ratio = rejected_ratio = None
    if settings.needs_reference:
        if reference_chosen is None or reference_rejected is None:
            needing = [name for name in settings.loss_types if name not in REFERENCE_FREE]
            raise SettingError("loss_type", f" {needing} compare the policy with a reference, and no reference"
                               " log-probs were given (the reference-free losses: " + ", ".join(REFERENCE_FREE) + ")")
        ref_chosen, ref_rejected = reference_chosen.sums.detach().float(), reference_rejected.sums.detach().float()
        chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    return _Pairs(chosen, rejected, chosen / chosen_tokens, rejected / rejected_tokens, chosen_ratio,
                  rejected_ratio, ref_chosen, ref_rejected, chosen_tokens, rejected_tokens)


def _rewards(settings: PreferenceLossSettings, p: _Pairs) -> tuple[Tensor, Tensor]:
    if p.chosen_ratio is not None:  # TRL DPOTrainer's rewards/*: beta times the summed log-ratio
        return (settings.beta * p.chosen_ratio).detach(), (settings.beta * p.rejected_ratio).detach()
    first = next((name for name in settings.loss_types if name in ("simpo", "orpo")), "simpo")
    scale = settings.orpo_lambda if first == "orpo" else settings.beta  # TRL ORPOTrainer's / CPOTrainer's
    return (scale * p.chosen_mean).detach(), (scale * p.rejected_mean).detach()


def preference_loss(
    settings: PreferenceLossSettings,
    policy_chosen: SequenceLogps,
    policy_rejected: SequenceLogps,
    reference_chosen: SequenceLogps | None,
    reference_rejected: SequenceLogps | None,
) -> PreferenceLossOutput:
    """The weighted sum of ``settings.loss_types`` for each pair of one micro-batch.

    The reference may be None when :attr:`PreferenceLossSettings.needs_reference` is False; a
    reference given to reference-free losses is not read. ``aot`` and ``aot_unpaired`` sort over
    the pairs given here, so their per-pair losses depend on the micro-batch; every other loss of
    a pair reads that pair only.

    Raises:
        SettingError: naming ``loss_type`` when a loss needs a reference and none was given.
    """
    p = _pairs(settings, policy_chosen, policy_rejected, reference_chosen, reference_rejected)
    pair_losses = torch.zeros_like(p.chosen)
    nll_weight = 0.0
    for name, weight in zip(settings.loss_types, settings.weights):
        if name in _LOSSES:
            pair_losses = pair_losses + weight * _LOSSES[name](p, settings)
        nll_weight += weight * _NLL.get(name, 0.0)
    chosen_rewards, rejected_rewards = _rewards(settings, p)
    return PreferenceLossOutput(pair_losses, nll_weight, chosen_rewards, rejected_rewards)


def preference_metrics(output: PreferenceLossOutput, policy_chosen: SequenceLogps,
                       policy_rejected: SequenceLogps) -> dict[str, Tensor]:
    """TRL's metrics as 0-d device tensors (no host read), means over the micro-batch's pairs:
    ``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies`` (chosen reward strictly above
    rejected; a tie counts 0), ``rewards/margins``, ``logps/chosen``, ``logps/rejected`` (summed
    log-probs)."""
    chosen, rejected = output.chosen_rewards.detach(), output.rejected_rewards.detach()
    return {
        "rewards/chosen": chosen.mean(),
        "rewards/rejected": rejected.mean(),
        "rewards/accuracies": (chosen > rejected).float().mean(),
        "rewards/margins": (chosen - rejected).mean(),
        "logps/chosen": policy_chosen.sums.detach().float().mean(),
        "logps/rejected": policy_rejected.sums.detach().float().mean(),
    }
