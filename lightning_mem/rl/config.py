"""The PPO/GRPO knobs as typed groups, each a YAML section under ``model:``.

Dataclasses rather than loose keyword arguments: LightningCLI checks every key (a typo is an
error, not a silently ignored setting), ``--print_config`` shows every default. Ranges are typed
constraints on the annotations: the parser rejects a bad value naming its full key, before any
model is loaded, and a group built in Python checks the same annotations (and the rules that relate
several fields) in ``__post_init__``, naming the field (:mod:`lightning_mem.settings`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Literal

from jsonargparse.typing import (
    ClosedUnitInterval,
    NonNegativeFloat,
    OpenUnitInterval,
    PositiveFloat,
    PositiveInt,
)

from lightning_mem.rl.algorithms import KLEstimator
from lightning_mem.rl.loss_aggregation import LossAggMode
from lightning_mem.rl.policy_losses import SEQUENCE_LOSSES, PolicyLoss
from lightning_mem.rl.rollout_correction import CorrectionLevel, CorrectionMode
from lightning_mem.settings import AtLeastTwo, SettingError, check_fields


@dataclass
class OverlongConfig:
    """What happens to a response cut off at ``max_new_tokens`` (YAML ``model.ppo.overlong``;
    DAPO, Yu et al. 2025, sec. 3.4; :mod:`lightning_mem.rl.sample_filters`).

    Args:
        filter: drop truncated responses (full length, no end token) from the loss: their score
            judged an unfinished answer.
        buffer: the soft penalty's ramp, in tokens before ``max_new_tokens``: a response longer than
            ``max_new_tokens - buffer`` loses up to ``penalty_factor`` of score (None: no penalty).
        penalty_factor: the penalty at full length.
    """

    filter: bool = False
    buffer: PositiveInt | None = None
    penalty_factor: PositiveFloat = 1.0

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass
class RolloutCorrectionConfig:
    """Importance sampling against the rollout engine's drift (YAML ``model.ppo.rollout_correction``;
    :mod:`lightning_mem.rl.rollout_correction`), from the engine's own log-probs of its samples.

    Args:
        mode: ``none``; ``tis`` (truncated: weight min(pi_old / pi_engine, upper)); ``mis``
            (masked: drop what falls outside [lower, upper]).
        level: ``token`` (each token's ratio) or ``sequence`` (the product over the response).
        upper: the TIS cap, or MIS's upper bound; above 1.
        lower: MIS's lower bound, below 1 (None: none; verl's `rollout_rs_threshold_lower` defaults to
            1 / upper instead). TIS has no lower bound.
    """

    mode: CorrectionMode = "none"
    level: CorrectionLevel = "token"
    upper: PositiveFloat = 2.0
    lower: OpenUnitInterval | None = None

    def __post_init__(self) -> None:
        check_fields(self)
        if self.upper <= 1.0:
            # A bound below 1 would cut or drop tokens on which the engine and trainer agree.
            raise SettingError("upper", f" must be above 1, got {self.upper}")
        if self.lower is not None and self.mode != "mis":
            raise SettingError("lower", f" is a bound of `mode: mis`, not of `mode: {self.mode}`", siblings=("mode",))

    @property
    def enabled(self) -> bool:
        return self.mode != "none"


#: The keys of ``model.ppo`` that belong to one policy loss.
_LOSS_KEYS = {"clip_cov": ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"), "kl_cov": ("kl_cov_ratio", "kl_cov_coef")}
_warned: set[str] = set()


def _warn_once(message: str) -> None:
    # The CLI builds the group more than once (parsing, then the module): one warning per process.
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, UserWarning, stacklevel=3)


@dataclass
class PPOConfig:
    """The update (YAML ``model.ppo``).

    Args:
        ppo_epochs: passes over each rollout batch.
        num_mini_batches: optimizer steps per pass; the batch is reshuffled and split this many ways.
        clip_ratio: epsilon of the clipped surrogate, ratio kept in [1 - eps, 1 + eps].
        clip_ratio_low, clip_ratio_high: the two sides separately (DAPO's clip-higher: 0.2 and
            0.28); None: ``clip_ratio``. For ``cispo`` they bound the importance weight.
        clip_ratio_c: the dual clip's bound on the loss of a negative-advantage token, ``-A * c``
            (> 1; verl's default is 3); None: off. ``vanilla`` only.
        policy_loss: ``vanilla`` (PPO's clipped surrogate), ``gspo`` (one geometric-mean ratio per
            response), ``cispo`` (clipped, detached importance weight on REINFORCE's gradient),
            ``clip_cov`` / ``kl_cov`` (PPO without the gradient of, or with a KL penalty on, the few
            tokens whose covariance of log-prob and advantage is largest: entropy control) or
            ``geo_mean`` (GMPO: the clipped geometric mean of the token ratios)
            (:mod:`lightning_mem.rl.policy_losses`).
        clip_cov_ratio, clip_cov_lb, clip_cov_ub: ``clip_cov``: the share of a micro-batch's tokens
            taken out of the update, and the covariance range they are drawn from (None: verl's
            2e-4, 1 and 5).
        kl_cov_ratio, kl_cov_coef: ``kl_cov``: the share of tokens penalised and the penalty's
            coefficient (None: verl's ``kl_cov_ratio`` 2e-4 and ``ppo_kl_coef`` 0.1).
        loss_agg_mode: how per-token losses are averaged: ``token-mean``, ``seq-mean-token-sum``,
            ``seq-mean-token-mean`` or ``seq-mean-token-sum-norm`` (divided by ``max_new_tokens``)
            (:mod:`lightning_mem.rl.loss_aggregation`). The same for the value, KL and entropy terms.
            None (the default): ``seq-mean-token-mean`` for the sequence losses (``gspo``,
            ``geo_mean``: verl always aggregates them so), ``token-mean`` for the rest. Another mode
            with a sequence loss is allowed, with one warning that verl differs.
        filter_groups: drop groups whose answers all scored alike from the loss (DAPO's dynamic
            sampling condition); grouped estimators only.
        overlong: truncated responses (:class:`OverlongConfig`).
        rollout_correction: TIS/MIS against the engine's drift (:class:`RolloutCorrectionConfig`).
        value_clip: how far the new values may move from the rollout's (None: no clipping).
        vf_coef: weight of the value loss in the summed loss.
        entropy_coef: weight of the entropy bonus (0 computes entropy for the metric only).
        max_grad_norm: gradient clipping per optimizer step (None: off).
        gamma, lam: GAE's discount and trace decay (``gamma`` is REINFORCE++'s discount too).
        whiten_advantages: GAE only: normalise the advantages to zero mean and unit variance over
            the batch (all ranks). None (the default) whitens under GAE. GRPO's group-relative
            scores reach the loss as they are (whitening them again would give a group that
            scored all alike a non-zero advantage, and undo Dr. GRPO's unscaled variant), so
            ``true`` without GAE is an error (REINFORCE++ whitens as part of its definition).
        max_tokens_per_microbatch: padded-token budget of a training micro-batch (forward +
            backward); None puts the whole mini-batch in one.
        logprob_max_tokens_per_microbatch: budget for the no-grad passes (old and reference
            logprobs, values, reward model). No activations are kept there, so it can be
            several times larger. None: same as ``max_tokens_per_microbatch``.
        packing: padding-free micro-batches in the score, reference, critic and train passes:
            each micro-batch's sequences (prompt + response) run as one row, position ids
            restarting per sequence, no attention mask (:mod:`lightning_mem.data.packing`); the
            budgets above then count the real tokens of the row, not ``longest x count``. The
            per-token results are unpacked to ``[sequences, response]``, so GAE, the group maths
            and the losses are unchanged: packed = padded to 1e-5 (``tests/rl/test_packed_passes.py``).
    """

    ppo_epochs: PositiveInt = 1
    num_mini_batches: PositiveInt = 1
    clip_ratio: OpenUnitInterval = 0.2
    clip_ratio_low: ClosedUnitInterval | None = None
    clip_ratio_high: PositiveFloat | None = None
    clip_ratio_c: PositiveFloat | None = None
    policy_loss: PolicyLoss = "vanilla"
    clip_cov_ratio: OpenUnitInterval | None = None
    clip_cov_lb: float | None = None
    clip_cov_ub: float | None = None
    kl_cov_ratio: OpenUnitInterval | None = None
    kl_cov_coef: NonNegativeFloat | None = None
    loss_agg_mode: LossAggMode | None = None
    filter_groups: bool = False
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    value_clip: PositiveFloat | None = 0.2
    vf_coef: NonNegativeFloat = 0.1
    entropy_coef: NonNegativeFloat = 0.0
    max_grad_norm: PositiveFloat | None = 1.0
    gamma: ClosedUnitInterval = 1.0
    lam: ClosedUnitInterval = 0.95
    whiten_advantages: bool | None = None
    max_tokens_per_microbatch: PositiveInt | None = None
    logprob_max_tokens_per_microbatch: PositiveInt | None = None
    packing: bool = False

    def __post_init__(self) -> None:
        # jsonargparse may hand the nested groups over as dicts when the class is built directly.
        if isinstance(self.overlong, dict):
            self.overlong = OverlongConfig(**self.overlong)
        if isinstance(self.rollout_correction, dict):
            self.rollout_correction = RolloutCorrectionConfig(**self.rollout_correction)
        check_fields(self)
        if self.clip_ratio_c is not None:
            if self.clip_ratio_c <= 1.0:
                # -A * c with c <= 1 would sit below the clipped surrogate's own value.
                raise SettingError("clip_ratio_c", f" must be above 1, got {self.clip_ratio_c}")
            if self.policy_loss != "vanilla":
                raise SettingError(
                    "clip_ratio_c", f" (the dual clip) is a term of `policy_loss: vanilla`, not of"
                    f" `policy_loss: {self.policy_loss}`", siblings=("policy_loss",))
        for loss, keys in _LOSS_KEYS.items():
            for key in keys:
                if getattr(self, key) is not None and self.policy_loss != loss:
                    raise SettingError(key, f" is a setting of `policy_loss: {loss}`, not of"
                                       f" `policy_loss: {self.policy_loss}`", siblings=("policy_loss",))
        lower, upper = self.loss_options.get("lower"), self.loss_options.get("upper")
        if lower is not None and lower >= upper:
            raise SettingError("clip_cov_lb", f" ({lower}) must be below `clip_cov_ub` ({upper}): no token's"
                               " covariance can lie between them", siblings=("clip_cov_ub",))
        if self.policy_loss in SEQUENCE_LOSSES and self.loss_agg_mode not in (None, "seq-mean-token-mean"):
            _warn_once(
                f"`model.ppo.loss_agg_mode: {self.loss_agg_mode}` with `policy_loss: {self.policy_loss}`: verl always"
                f" aggregates {self.policy_loss} per response (`seq-mean-token-mean`, the paper's objective), so this"
                " config trains a different objective than verl's. Leave `loss_agg_mode` unset to match it."
            )

    @property
    def agg_mode(self) -> str:
        """``loss_agg_mode``, or its default for ``policy_loss`` when unset."""
        if self.loss_agg_mode is not None:
            return self.loss_agg_mode
        return "seq-mean-token-mean" if self.policy_loss in SEQUENCE_LOSSES else "token-mean"

    @property
    def loss_options(self) -> dict[str, Any]:
        """The chosen policy loss's own settings, verl's defaults filled in (keyword arguments of
        :func:`lightning_mem.rl.policy_losses.policy_loss`)."""
        pick = lambda value, default: default if value is None else value  # noqa: E731
        if self.policy_loss == "clip_cov":
            return {"ratio": pick(self.clip_cov_ratio, 2e-4), "lower": pick(self.clip_cov_lb, 1.0),
                    "upper": pick(self.clip_cov_ub, 5.0)}
        if self.policy_loss == "kl_cov":
            return {"ratio": pick(self.kl_cov_ratio, 2e-4), "coef": pick(self.kl_cov_coef, 0.1)}
        return {}

    @property
    def clip_low(self) -> float:
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def clip_high(self) -> float:
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high

    @property
    def logprob_budget(self) -> int | None:
        return self.logprob_max_tokens_per_microbatch or self.max_tokens_per_microbatch


@dataclass
class KLConfig:
    """The KL penalty towards the reference policy (YAML ``model.kl``).

    Args:
        coef: its coefficient (the initial one when adaptive). 0 with no ``target`` turns the
            penalty off, and no reference model is built at all.
        estimator: per-token estimator, ``k1`` | ``k2`` | ``k3`` | ``abs`` (see
            :mod:`lightning_mem.rl.algorithms`).
        target: a KL per sequence to hold with the adaptive controller (Ziegler et al.); None keeps
            ``coef`` fixed.
        horizon: the adaptive controller's time constant, in samples.
        in_reward: True subtracts ``coef * KL`` from each token's reward (InstructGPT's PPO);
            False adds ``coef * KL`` to the loss instead (GRPO's way; pair it with ``k3``).
    """

    coef: NonNegativeFloat = 0.05
    estimator: KLEstimator = "k1"
    target: PositiveFloat | None = None
    horizon: PositiveInt = 10000
    in_reward: bool = True

    def __post_init__(self) -> None:
        check_fields(self)
        if self.target is not None and self.coef <= 0:
            raise SettingError("target", " (adaptive KL) needs an initial `coef` > 0", siblings=("coef",))

    @property
    def enabled(self) -> bool:
        return self.coef > 0 or self.target is not None


@dataclass
class GRPOConfig:
    """Group-relative advantages (YAML ``model.grpo``; used by the grouped estimators: ``grpo``,
    ``rloo``, ``reinforce_pp_baseline``, ``opo``, ``grpo_passk``).

    Args:
        group_size: responses sampled per prompt; advantages compare each with its group.
        scale_rewards: ``grpo`` and ``grpo_passk``: divide by the group's standard deviation (False:
            Dr. GRPO's centring only; verl's ``norm_adv_by_std_in_grpo``).
    """

    group_size: AtLeastTwo = 4  # a group of one has nothing to compare its answer with
    scale_rewards: bool = True

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass
class CriticConfig:
    """The value model (YAML ``model.critic``; not built under GRPO).

    Args:
        layout: ``separate``: its own backbone + value head, own optimizer
            (``model.critic_optimizer``); ``shared``: a value head on the actor's backbone,
            trained with the actor's optimizer.
        name_or_path: checkpoint of the separate critic's backbone; None starts it from the actor's.
        dtype: its parameter dtype. It trains, so it follows ``trainer.precision`` (float32 under
            ``32-true`` and ``*-mixed``); None follows it, and any other dtype is an error.
    """

    layout: Literal["separate", "shared"] = "separate"
    name_or_path: str | None = None
    dtype: str | None = None

    def __post_init__(self) -> None:
        check_fields(self)


#: How a reward-model ensemble's member scores become one (``model.reward_model.aggregate``).
REWARD_AGGREGATES = ("mean", "min", "mean_minus_std")


@dataclass
class RewardModelConfig:
    """A learned reward (YAML ``model.reward_model``): a sequence classifier with one output, or an
    ensemble of them whose scores are aggregated (Coste et al. 2023, "Reward Model Ensembles Help
    Mitigate Overoptimization": reward models trained apart err on different responses).

    Args:
        name_or_path: its checkpoint (with its own tokenizer), or a list of them: an ensemble,
            each member with its own tokenizer. A single string keeps the plain reward model.
        dtype: parameter dtype of every member. It is frozen: None loads it in the compute dtype of
            ``trainer.precision`` (bfloat16 under ``bf16-mixed``, float32 under ``32-true``);
            ``auto`` keeps the checkpoint's; under ``*-true`` only the precision's dtype holds.
        max_length: tokens per scored conversation (cut from the left).
        aggregate: an ensemble's score of a response from its members': ``mean``; ``min`` (the
            worst case); ``mean_minus_std`` (mean minus ``uncertainty_coef`` times the members'
            population std: uncertainty-weighted).
        uncertainty_coef: the std's weight under ``aggregate: mean_minus_std`` (None: 1.0).
    """

    name_or_path: str | list[str]
    dtype: str | None = None
    max_length: PositiveInt = 2048
    aggregate: str = "mean"
    uncertainty_coef: float | None = None

    def __post_init__(self) -> None:
        check_fields(self)
        paths = self.name_or_path
        if isinstance(paths, (list, tuple)):
            if not paths:
                raise SettingError("name_or_path", " is an empty list: give one reward model's folder, or several")
            repeated = sorted({p for p in paths if paths.count(p) > 1})
            if repeated:
                raise SettingError("name_or_path", f" lists {repeated[0]} twice: a repeated member adds no"
                                   " second opinion, it only weighs that model more")
            self.name_or_path = list(paths)
        if self.aggregate not in REWARD_AGGREGATES:
            raise SettingError("aggregate", f" must be one of {REWARD_AGGREGATES}, got {self.aggregate!r}")
        if self.uncertainty_coef is not None:
            if self.aggregate != "mean_minus_std":
                raise SettingError("uncertainty_coef", f" is a setting of `aggregate: mean_minus_std`, not of"
                                   f" `aggregate: {self.aggregate}`", siblings=("aggregate",))
            if self.uncertainty_coef < 0:
                raise SettingError("uncertainty_coef", f" must be >= 0, got {self.uncertainty_coef}")

    @property
    def paths(self) -> list[str]:
        """Every member's checkpoint (one for a plain reward model)."""
        return [self.name_or_path] if isinstance(self.name_or_path, str) else list(self.name_or_path)
