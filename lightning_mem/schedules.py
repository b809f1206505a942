"""Learning-rate schedules that take plain numbers, so a YAML ``lr_scheduler`` can name them.

A schedule's horizon is the run's: leave ``total_steps`` out of the YAML and
:func:`build_lr_scheduler` fills it from the trainer (``max_steps``, or the epochs' estimated
optimizer steps), so ``--trainer.max_steps 50`` decays the rate over 50 steps. A warmup longer than
the run (a smoke test with ``--trainer.max_steps 6`` of a config that warms up over 20) is shortened
to the run: :func:`check_schedule` says so once, before any model is loaded, and
:func:`build_lr_scheduler` builds the shortened schedule.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_mem.settings import SettingError


class WarmupCosineLR(torch.optim.lr_scheduler.LambdaLR):
    """Linear warmup over ``warmup_steps``, then cosine decay to ``min_lr_ratio`` x the peak at ``total_steps``.

    ``total_steps=None`` (the default) means "the whole run": the recipes pass the trainer's
    horizon through :func:`build_lr_scheduler`. Constructed directly, it must be given.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_steps: int,
        total_steps: int | None = None,
        min_lr_ratio: float = 0.1,
        last_epoch: int = -1,
    ) -> None:
        if total_steps is None:
            raise ValueError(
                "WarmupCosineLR needs `total_steps`: give it, or build the scheduler with"
                " lightning_mem.schedules.build_lr_scheduler, which takes it from the trainer"
            )
        if total_steps <= 0 or warmup_steps < 0 or warmup_steps > total_steps:
            raise ValueError(
                f"WarmupCosineLR needs 0 <= warmup_steps <= total_steps, total_steps > 0; got {warmup_steps}, {total_steps}"
            )
        self.warmup_steps, self.total_steps, self.min_lr_ratio = warmup_steps, total_steps, min_lr_ratio
        super().__init__(optimizer, self._factor, last_epoch=last_epoch)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # The schedule's shape is the current run's config (its horizon follows trainer.max_steps):
        # a run resumed with a larger max_steps decays over the new horizon, exactly as a run
        # started with it would; only the position (step count, base rates) comes from the checkpoint.
        shape = ("warmup_steps", "total_steps", "min_lr_ratio")
        super().load_state_dict({k: v for k, v in state_dict.items() if k not in shape})

    def _factor(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def _keywords(factory: Any) -> dict[str, Any]:
    # LightningCLI's LRSchedulerCallable is a functools.partial holding the YAML's init_args.
    return dict(getattr(factory, "keywords", None) or {})


def scheduler_horizon(trainer: Any, *, steps_per_batch: int = 1, optimizers: int = 1) -> int:
    """How many times a scheduler stepped every optimizer step will step in this run.

    Args:
        steps_per_batch: scheduler steps per training batch: 1 for SFT; PPO steps
            ``ppo_epochs x num_mini_batches`` times per batch of prompts.
        optimizers: optimizers whose steps each count in ``global_step`` (manual optimization
            counts every ``optimizer.step()``, so PPO with a separate critic counts 2 per update).
    """
    if trainer.max_steps is not None and trainer.max_steps >= 0:
        return max(1, math.ceil(trainer.max_steps / optimizers))
    batches = trainer.estimated_stepping_batches
    if not math.isfinite(batches):
        raise SettingError(
            "trainer.max_steps",
            "`trainer.max_steps` and `trainer.max_epochs` are both unlimited, so the learning-rate schedule has no"
            " horizon: set one of them, or the scheduler's `total_steps`"
        )
    return max(1, int(batches) * steps_per_batch)


def _warmup_cap(args: dict[str, Any], horizon: int) -> int | None:
    """The steps a too-long ``warmup_steps`` is shortened to (the schedule's length), or None if it fits."""
    warmup, total = args.get("warmup_steps"), args.get("total_steps")
    length = total if isinstance(total, int) else horizon
    return length if isinstance(warmup, int) and warmup > length else None


def check_schedule(factory: Any, trainer: Any, *, key: str = "lr_scheduler", **horizon_kwargs: Any) -> None:
    """Before any model loads: warn where the schedule does not match the run.

    A warmup longer than the run is shortened to the run (:func:`build_lr_scheduler` does it): a
    short smoke test of a long config then runs instead of failing. A ``total_steps`` other than
    the run's also warns. ``key`` names the scheduler's setting in messages (the recipes pass
    ``model.lr_scheduler``).
    """
    if factory is None:
        return
    args = _keywords(factory)
    warmup, total = args.get("warmup_steps"), args.get("total_steps", "absent")
    if warmup is None and total in (None, "absent"):
        return
    horizon = scheduler_horizon(trainer, **horizon_kwargs)
    where = f"trainer.max_steps={trainer.max_steps}" if trainer.max_steps >= 0 else f"trainer.max_epochs={trainer.max_epochs}"
    cap = _warmup_cap(args, horizon)
    if cap is not None:
        rank_zero_warn(
            f"`{key}.init_args.warmup_steps`={warmup} is longer than the run ({horizon} scheduler steps, {where}):"
            f" warming up over {cap} steps instead. Lower warmup_steps to silence this."
        )
    if isinstance(total, int) and total != horizon:
        rank_zero_warn(
            f"`{key}.init_args.total_steps`={total} but this run takes {horizon} scheduler steps ({where}): the"
            f" learning rate {'stops decaying early' if total < horizon else 'never finishes decaying'}. Remove"
            " total_steps to follow the trainer."
        )


def build_lr_scheduler(factory: Any, optimizer: torch.optim.Optimizer, trainer: Any, **horizon_kwargs: Any) -> Any:
    """``factory(optimizer)``, with ``total_steps`` from :func:`scheduler_horizon` where the YAML left it
    out, and a warmup longer than the schedule shortened to it (:func:`check_schedule` warned)."""
    args = _keywords(factory)
    if not ("total_steps" in args or "warmup_steps" in args):
        return factory(optimizer)
    horizon = scheduler_horizon(trainer, **horizon_kwargs)
    overrides: dict[str, Any] = {}
    if "total_steps" in args and args["total_steps"] is None:
        overrides["total_steps"] = horizon
    cap = _warmup_cap(args, horizon)
    if cap is not None:
        overrides["warmup_steps"] = cap
    return factory(optimizer, **overrides)
