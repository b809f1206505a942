"""What a recipe's step takes from the run it is in: the micro-batch plan and generation.

A recipe's ``training_step`` is the algorithm. Two of the things it does repeat one shape many
times, and *who runs the step* decides whether every repetition must run:

- **the micro-batch plan** -- ``io.micro_batches(lengths, max_tokens, agree_on_count=...)``: which
  samples go through the model together, micro-batch after micro-batch;
- **repeated loops** -- ``for mini in io.repeats(mini_batches):``: PPO's epochs and mini-batches;
- **generation** -- ``with io.generation(model):`` around sampling with ``model.generate``, decode
  step after decode step;
- **the rollout engine** -- ``io.rollout_engine(config, generation, ...)`` builds the engine that
  samples the rollouts. The estimate cannot run vLLM on fake tensors: it builds a stand-in that
  holds what vLLM holds on the device (:mod:`lightning_mem.estimate.engine`);
- **a pass over the data outside the steps** -- ``io.data_pass(split)``: the DPO recipe's reference
  precompute, before its first step. The plain run returns None (the recipe's data module serves
  the pass); the estimate has no data, and hands the recipe its largest micro-batch once, which
  stands for every batch of the pass (a pass without gradients leaves nothing from one batch to the
  next);
- **the generator processes** of separate placement -- ``io.async_client(spec, ...)``, a training
  rank's end of the rollout group. The estimate starts no process: its stand-in hands the trainer
  samples of the generator's shapes and estimates a generating rank on its own
  (:mod:`lightning_mem.estimate.generator`).

Lightning's ``Trainer.fit`` runs the plain :class:`StepIO`: every micro-batch and every decode step.
The memory estimate (:mod:`lightning_mem.estimate`) runs the *same* ``Trainer.fit`` on fake tensors
with a callback that is also a :class:`StepIO`, and skips the repetitions that cannot raise a peak
(the third and later micro-batches of one shape, the mini-batches and epochs after the first; the
decode steps between the first and the last).
:func:`step_io` finds it among the trainer's callbacks, so a recipe -- or a user's subclass of one --
is estimated by running its own code, never a copy of it. The phases a step reports (``rollout``,
``score``, ``train``) reach the estimate the way they reach the ``MemoryMonitor``:
:func:`lightning_mem.callbacks.memory_phase`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from torch import nn

T = TypeVar("T")


class StepIO:
    """The plain run: every micro-batch of the plan and every decode step runs."""

    def micro_batches(
        self, lengths: Sequence[int], max_tokens: int | None, *, agree_on_count: Callable[[int], int] | None = None
    ) -> list[list[int]]:
        """:func:`lightning_mem.rl.microbatch.micro_batches`: the samples' indices, micro-batch by micro-batch."""
        from lightning_mem.rl.microbatch import micro_batches

        return micro_batches(lengths, max_tokens, agree_on_count=agree_on_count)

    def repeats(self, items: Sequence[T]) -> Sequence[T]:
        """A loop whose iterations repeat the same work, each from the state an optimizer step
        left (PPO's epochs and mini-batches): every iteration."""
        return items

    def generation(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Around a rollout that samples with ``model.generate``."""
        return contextlib.nullcontext()

    def rollout_engine(self, config: Any, generation: Any, **kwargs: Any) -> Any:
        """:func:`lightning_mem.rl.engines.build_rollout_engine`: the engine ``config``
        (``model.rollout_engine``) names."""
        from lightning_mem.rl.engines import build_rollout_engine

        return build_rollout_engine(config, generation, **kwargs)

    def multi_turn_rollout(self, environment: Any, config: Any, **kwargs: Any) -> Any:
        """:func:`lightning_mem.rl.multi_turn.multi_turn_rollout`: trajectories of ``environment``
        within ``config``'s budgets (``model.environment``, ``model.multi_turn``)."""
        from lightning_mem.rl.multi_turn import multi_turn_rollout

        return multi_turn_rollout(environment, config, **kwargs)

    def async_client(self, spec: Any, **kwargs: Any) -> Any:
        """:class:`lightning_mem.rl.async_client.AsyncRolloutClient`: a training rank's end of separate
        placement's rollout group (rank 0 starts the generator processes ``spec`` describes)."""
        from lightning_mem.rl.async_client import AsyncRolloutClient

        return AsyncRolloutClient(spec, **kwargs)

    def data_pass(self, split: str) -> list[dict[str, Any]] | None:
        """The batches of a pass over ``split`` outside the training steps (the DPO recipe's reference
        precompute): None, the recipe's data module serves them."""
        return None

    def compute_dtype(self, trainer: Any, precision_dtype: Any) -> Any:
        """The dtype the model computes in: a sharding strategy's ``param_dtype`` (FSDP2's mixed
        precision) if it has one, else ``precision_dtype`` (the precision's)."""
        return getattr(trainer.strategy, "param_dtype", None) or precision_dtype

    def training_ranks(self, trainer: Any) -> int:
        """The run's training ranks (the estimate's one process stands for the config's)."""
        return int(trainer.world_size)


_PLAIN = StepIO()


def step_io(trainer: Any) -> StepIO:
    """The :class:`StepIO` of the run ``trainer`` is in: a callback that is one (the memory
    estimate's), else the plain one."""
    for callback in getattr(trainer, "callbacks", None) or []:
        if isinstance(callback, StepIO):
            return callback
    return _PLAIN
