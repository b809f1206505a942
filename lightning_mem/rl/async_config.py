"""The asynchronous rollout's settings (YAML ``model.async_rollout``), checked before any model loads.

They apply when ``model.rollout_engine.placement: separate`` runs generation in a process of its own
(:mod:`lightning_mem.rl.async_client`); under the default ``colocated`` placement they are unused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from jsonargparse.typing import NonNegativeInt, PositiveFloat

from lightning_mem.settings import AtLeastOne, SettingError, check_fields

LatePolicy = Literal["drop", "wait"]


@dataclass
class AsyncRolloutConfig:
    """How far generation may run ahead of training (in the PPO recipe: ``model.async_rollout``).

    The weight version is the number of PPO iterations whose update the weights hold. A sample
    drawn under version ``v`` and trained at iteration ``t`` is ``t - v`` versions stale.

    Args:
        max_staleness: ``k``, the most versions a trained sample may lag: 0 is synchronous (the
            generator samples iteration ``t``'s prompts under the weights of iteration ``t``), 1 is
            one-step off-policy. Kept by admission control: the generator does not start a batch
            whose samples would be more than ``k`` versions old when trained.
        late_policy: what happens to a batch that arrives more than ``k`` versions old anyway
            (admission control makes this a guard, not the normal path): ``drop`` takes its samples
            out of the step's loss, ``wait`` asks for the same prompts again under the current
            weights and trains on those. Either way the step's ``async/dropped`` counts them.
        weight_sync_steps: the trainer sends its weights to the generator after every this many
            iterations. At most ``max_staleness + 1``: a rarer sync would leave the generator
            holding weights too old to admit the next batch.
        timeout_s: the longest the trainer waits on any send to or receive from the generator
            (seconds). A generator that hung ends the run with one line naming it within this time;
            one that died, at the trainer's next send or receive. It must cover a generation (the
            trainer may wait for one batch). The generator waits for the trainer as long as the
            trainer lives; its start-up (loading its copy of the actor) has 10 minutes.
        rollout_correction: the rollout correction (TIS, truncated importance weights against the
            generator's log-probs, cap 2) is on by default in separate placement, where the
            sampling policy lags the trained one (the run says so in one line); false leaves
            ``model.ppo.rollout_correction`` as it is. A mode set there (``tis`` or ``mis``) is kept.
        cpu_threads: the generator process's CPU threads (``torch.set_num_threads``); None: torch's
            default. On a CPU-only machine give the trainer and the generator a share each.
        generator_devices: devices that generate, one generator process on each, every one with a
            whole copy of the actor's weights (in the compute dtype) and a KV cache of its own. They
            come on top of ``trainer.devices``: on a node of 8 GPUs, ``trainer.devices: 6`` and
            ``generator_devices: 2`` train on GPUs 0-5 and generate on 6 and 7 (training rank 0's
            node). Each generator samples the requests of the training ranks ``r`` with
            ``r % generator_devices`` equal to its index, one request (one rank's prompt batch) at
            a time. At most the number of training ranks (a generator with no rank to serve idles).
    """

    max_staleness: NonNegativeInt = 1
    late_policy: LatePolicy = "drop"
    weight_sync_steps: AtLeastOne = 1
    timeout_s: PositiveFloat = 600.0
    rollout_correction: bool = True
    cpu_threads: AtLeastOne | None = None
    generator_devices: AtLeastOne = 1

    def __post_init__(self) -> None:
        check_fields(self)
        if self.weight_sync_steps > self.max_staleness + 1:
            raise SettingError(
                "weight_sync_steps",
                f"={self.weight_sync_steps} with `max_staleness`={self.max_staleness}: the generator would hold weights"
                f" {self.weight_sync_steps - 1} versions old between syncs and could admit no batch; use at most"
                f" `max_staleness` + 1 = {self.max_staleness + 1}",
                siblings=("max_staleness",),
            )

    def late(self, sampled_version: int, trained_at: int) -> bool:
        """Whether a batch sampled under ``sampled_version`` is too old to train at ``trained_at``."""
        return trained_at - sampled_version > self.max_staleness

    def admits(self, request: int, held_version: int) -> bool:
        """Whether the generator, holding ``held_version``, may start the batch trained at ``request``."""
        return request - held_version <= self.max_staleness


def check_generator_devices(config: AsyncRolloutConfig, training_ranks: int) -> None:
    """Every generator has a training rank to serve (generator ``g`` serves ranks ``r % n == g``)."""
    if config.generator_devices > training_ranks:
        raise SettingError(
            "model.async_rollout.generator_devices",
            f"`model.async_rollout.generator_devices`={config.generator_devices} with {training_ranks} training"
            f" rank(s) (`trainer.devices` x `trainer.num_nodes`): each generator serves the requests of some"
            f" training ranks, so at most {training_ranks} generator(s)"
        )
