"""The PPO/GRPO knobs as typed groups, each a YAML section under ``model:``.

Dataclasses rather than loose keyword arguments: LightningCLI checks every key (a typo is an
error, not a silently ignored setting), ``--print_config`` shows every default, and each group
validates itself with messages that name the key, before any model is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lightning_mem.rl.algorithms import KL_ESTIMATORS


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

    ppo_epochs: int = 1
    num_mini_batches: int = 1
    clip_ratio: float = 0.2
    value_clip: float | None = 0.2
    vf_coef: float = 0.1
    entropy_coef: float = 0.0
    max_grad_norm: float | None = 1.0
    gamma: float = 1.0
    lam: float = 0.95
    whiten_advantages: bool | None = None
    max_tokens_per_microbatch: int | None = None
    logprob_max_tokens_per_microbatch: int | None = None

    def validate(self, key: str = "model.ppo") -> None:
        for name in ("ppo_epochs", "num_mini_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"`{key}.{name}` must be >= 1, got {getattr(self, name)}")
        if not 0 < self.clip_ratio < 1:
            raise ValueError(f"`{key}.clip_ratio` must be in (0, 1), got {self.clip_ratio}")
        if self.value_clip is not None and self.value_clip <= 0:
            raise ValueError(f"`{key}.value_clip` must be > 0 or null, got {self.value_clip}")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError(f"`{key}.max_grad_norm` must be > 0 or null, got {self.max_grad_norm}")
        for name in ("vf_coef", "entropy_coef"):
            if getattr(self, name) < 0:
                raise ValueError(f"`{key}.{name}` must be >= 0, got {getattr(self, name)}")
        for name in ("gamma", "lam"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"`{key}.{name}` must be in [0, 1], got {getattr(self, name)}")
        for name in ("max_tokens_per_microbatch", "logprob_max_tokens_per_microbatch"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"`{key}.{name}` must be positive or null, got {value}")

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

    coef: float = 0.05
    estimator: str = "k1"
    target: float | None = None
    horizon: int = 10000
    in_reward: bool = True

    def validate(self, key: str = "model.kl") -> None:
        if self.coef < 0:
            raise ValueError(f"`{key}.coef` must be >= 0, got {self.coef}")
        if self.estimator not in KL_ESTIMATORS:
            raise ValueError(f"`{key}.estimator` must be one of {KL_ESTIMATORS}, got {self.estimator!r}")
        if self.target is not None and (self.target <= 0 or self.coef <= 0):
            raise ValueError(f"`{key}.target` (adaptive KL) needs target > 0 and an initial coef > 0")
        if self.horizon <= 0:
            raise ValueError(f"`{key}.horizon` must be positive, got {self.horizon}")

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

    group_size: int = 4
    scale_rewards: bool = True

    def validate(self, key: str = "model.grpo") -> None:
        if self.group_size < 2:
            raise ValueError(f"`{key}.group_size` must be >= 2 (a group of one has nothing to compare), got {self.group_size}")


@dataclass
class CriticConfig:
    """The value model (YAML ``model.critic``; not built under GRPO).

    Args:
        layout: ``separate``: its own backbone + value head, own optimizer
            (``model.critic_optimizer``); ``shared``: a value head on the actor's backbone,
            trained with the actor's optimizer.
        name_or_path: checkpoint of the separate critic's backbone; None starts it from the actor's.
        dtype: its parameter dtype; None: the actor's ``dtype``.
    """

    layout: Literal["separate", "shared"] = "separate"
    name_or_path: str | None = None
    dtype: str | None = None

    def validate(self, key: str = "model.critic") -> None:
        if self.layout not in ("separate", "shared"):
            raise ValueError(f"`{key}.layout` must be 'separate' or 'shared', got {self.layout!r}")


@dataclass
class RewardModelConfig:
    """A learned reward (YAML ``model.reward_model``): a sequence classifier with one output.

    Args:
        name_or_path: its checkpoint (with its own tokenizer).
        dtype: parameter dtype; None: the actor's ``dtype``.
        max_length: tokens per scored conversation (cut from the left).
    """

    name_or_path: str
    dtype: str | None = None
    max_length: int = 2048
