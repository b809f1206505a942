"""The PPO/GRPO knobs as typed groups, each a YAML section under ``model:``.

Dataclasses rather than loose keyword arguments: LightningCLI checks every key (a typo is an
error, not a silently ignored setting), ``--print_config`` shows every default. Ranges are typed
constraints on the annotations: the parser rejects a bad value naming its full key, before any
model is loaded, and a group built in Python checks the same annotations (and the rules that relate
several fields) in ``__post_init__``, naming the field (:mod:`lightning_mem.settings`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from jsonargparse.typing import (
    ClosedUnitInterval,
    NonNegativeFloat,
    OpenUnitInterval,
    PositiveFloat,
    PositiveInt,
)

from lightning_mem.rl.algorithms import KLEstimator
from lightning_mem.settings import AtLeastTwo, SettingError, check_fields


@dataclass
class PPOConfig:
    """The update (YAML ``model.ppo``).

    Args:
        ppo_epochs: passes over each rollout batch.
        num_mini_batches: optimizer steps per pass; the batch is reshuffled and split this many ways.
        clip_ratio: epsilon of the clipped surrogate, ratio kept in [1 - eps, 1 + eps].
        value_clip: how far the new values may move from the rollout's (None: no clipping).
        vf_coef: weight of the value loss in the summed loss.
        entropy_coef: weight of the entropy bonus (0 computes entropy for the metric only).
        max_grad_norm: gradient clipping per optimizer step (None: off).
        gamma, lam: GAE's discount and trace decay.
        whiten_advantages: GAE only: normalise the advantages to zero mean and unit variance over
            the batch (all ranks). None (the default) whitens under GAE. GRPO's group-relative
            scores reach the loss as they are (whitening them again would give a group that
            scored all alike a non-zero advantage, and undo Dr. GRPO's unscaled variant), so
            ``true`` with GRPO is an error.
        max_tokens_per_microbatch: padded-token budget of a training micro-batch (forward +
            backward); None puts the whole mini-batch in one.
        logprob_max_tokens_per_microbatch: budget for the no-grad passes (old and reference
            logprobs, values, reward model). No activations are kept there, so it can be
            several times larger. None: same as ``max_tokens_per_microbatch``.
    """

    ppo_epochs: PositiveInt = 1
    num_mini_batches: PositiveInt = 1
    clip_ratio: OpenUnitInterval = 0.2
    value_clip: PositiveFloat | None = 0.2
    vf_coef: NonNegativeFloat = 0.1
    entropy_coef: NonNegativeFloat = 0.0
    max_grad_norm: PositiveFloat | None = 1.0
    gamma: ClosedUnitInterval = 1.0
    lam: ClosedUnitInterval = 0.95
    whiten_advantages: bool | None = None
    max_tokens_per_microbatch: PositiveInt | None = None
    logprob_max_tokens_per_microbatch: PositiveInt | None = None

    def __post_init__(self) -> None:
        check_fields(self)

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
    """Group-relative advantages (YAML ``model.grpo``; used when ``advantage_estimator: grpo``).

    Args:
        group_size: responses sampled per prompt; advantages compare each with its group.
        scale_rewards: divide by the group's standard deviation (False: Dr. GRPO's centring only).
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


@dataclass
class RewardModelConfig:
    """A learned reward (YAML ``model.reward_model``): a sequence classifier with one output.

    Args:
        name_or_path: its checkpoint (with its own tokenizer).
        dtype: parameter dtype. It is frozen: None loads it in the compute dtype of
            ``trainer.precision`` (bfloat16 under ``bf16-mixed``, float32 under ``32-true``);
            ``auto`` keeps the checkpoint's; under ``*-true`` only the precision's dtype holds.
        max_length: tokens per scored conversation (cut from the left).
    """

    name_or_path: str
    dtype: str | None = None
    max_length: PositiveInt = 2048

    def __post_init__(self) -> None:
        check_fields(self)
