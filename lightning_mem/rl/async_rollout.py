"""The trainer's schedule of separate placement: prompts ahead, samples in, weights out, staleness kept.

:class:`AsyncRollouts` sits between a recipe's step and :class:`~lightning_mem.rl.async_client.AsyncRolloutClient`.
At iteration ``t`` it has sent the prompts of iterations up to ``t + max_staleness`` (read ahead of the
loader, :meth:`~lightning_mem.batching.TokenBudgetSampler.batch_at`), takes iteration ``t``'s samples
and the version each was sampled under, and after the update sends the weights when a sync is due.
With ``max_staleness: 0`` it sends the trainer's random state along and takes it back, so the
generator draws exactly the samples the colocated run would. With ``greedy_baseline`` (ReMax) every
request asks for one greedy answer per row too, decoded by the generator right after the request's
samples under the same weights (:class:`GreedyAnswers`): a baseline always has its samples' version.

The version counter is in the checkpoint. A resumed run starts a new generator with an empty queue:
the queue is *rebuilt* from the resumed iteration's prompts (samples in flight at the checkpoint
were never saved), and the run says so.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from lightning_mem.rl.async_client import AsyncRolloutClient
from lightning_mem.rl.async_config import AsyncRolloutConfig
from lightning_mem.rl.multi_turn import with_trajectory_extras
from lightning_mem.rl.rollout_link import json_of
from lightning_mem.rl.rollout import Experience

log = logging.getLogger(__name__)

_SAMPLES = 6  # a batch's sample tensors (rollout_link's SAMPLE_BATCH); the greedy answers' 2 follow


class GreedyAnswers(NamedTuple):
    """The greedy answer to each request row (ReMax's baseline), sampled beside the request's samples
    under the same weights: ``response_ids`` ``[N, R]`` and ``response_lengths`` ``[N]``."""

    response_ids: Tensor
    response_lengths: Tensor


class AsyncRollouts:
    """Args:
        config: ``model.async_rollout``.
        client: the rollout group's end on this rank (started).
        prompts: iteration -> that iteration's prompt batch on this rank (``input_ids``, ``attention_mask``).
        group_size: copies of each prompt sampled (GRPO's group).
        greedy_baseline: ask for one greedy answer per row too (ReMax's baseline).
        multi_turn: the generator runs trajectories against an environment: requests carry the data
            rows, and batches the trajectories' scores, masks and counts.
        say: where the run's lines go (resume, drain); a recipe passes its rank-zero logger.
    """

    def __init__(self, config: AsyncRolloutConfig, client: AsyncRolloutClient, prompts: Callable[[int], dict[str, Any]],
                 *, group_size: int = 1, greedy_baseline: bool = False, multi_turn: bool = False,
                 say: Callable[[str], None] = log.info) -> None:
        self.config, self.client, self.prompts, self.group_size = config, client, prompts, group_size
        self.greedy_baseline, self.multi_turn = greedy_baseline, multi_turn
        self.say = say
        self.version = 0  # the weights' version: PPO iterations whose update they hold
        self.resumed = False
        self._started = False
        self._sent: dict[int, Tensor] = {}  # iteration -> the prompt ids sent (to check the loader agrees)
        self._arrived: dict[int, tuple[int, list[Tensor]]] = {}

    # -- checkpoint ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, int]:
        return {"version": self.version}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.version = int(state["version"])
        self.resumed = True

    # -- the step ----------------------------------------------------------------------------------
    def rollout(self, iteration: int, batch: dict[str, Any], actor: nn.Module,
                ) -> tuple[Experience, GreedyAnswers | None, dict[str, float]]:
        """Iteration ``iteration``'s samples (of ``batch``'s prompts), each tagged in ``Experience.versions``
        with the version it was sampled under; the greedy answers sampled with them, if asked for (else
        None); and the step's async metrics (histogram, dropped, waits)."""
        k = self.config.max_staleness
        if not self._started:
            self._start(iteration, actor)
        lockstep = k == 0
        for ahead in range(self.client.submitted + 1, iteration + k + 1):
            self._submit(ahead, batch if ahead == iteration else self.prompts(ahead),
                         rng_state=torch.get_rng_state() if lockstep else None)
        self._check_same_prompts(iteration, batch)
        t0 = time.perf_counter()
        version, tensors = self._take(iteration)
        redone = 0
        if self.config.late(version, iteration) and self.config.late_policy == "wait":
            redone = len(tensors[0])
            self._submit(iteration, batch, rng_state=None)
            self._sent.pop(iteration)
            version, tensors = self._take(iteration)
        waited = time.perf_counter() - t0
        greedy = GreedyAnswers(*tensors[_SAMPLES: _SAMPLES + 2]) if self.greedy_baseline else None
        if len(tensors) > _SAMPLES + 2 * self.greedy_baseline + self.multi_turn:  # lockstep: the generator's random state
            torch.set_rng_state(tensors[-1])
        exp = _experience(tensors, self.group_size)
        if self.multi_turn:  # the trajectories' scores, masks, counts and texts
            with_trajectory_extras(exp, json_of(tensors[_SAMPLES]))
        exp.versions = torch.full((len(exp),), version, dtype=torch.long, device=exp.input_ids.device)
        stale = iteration - version
        n = float(len(exp))
        metrics = {f"async/staleness_{j}": (n if stale == j else 0.0) for j in range(k + 1)}
        dropped = n if self.config.late(version, iteration) else 0.0
        metrics.update({"async/dropped": dropped + redone, "async/late": n if stale > k else 0.0,
                        "async/sampled_version": float(version), "async/wait_s": waited})
        return exp, greedy, metrics

    def after_update(self, iteration: int, actor: nn.Module) -> None:
        """The weights now hold iteration ``iteration``'s update: send them if a sync is due."""
        self.version = iteration + 1
        if self.version % self.config.weight_sync_steps == 0:
            self.client.sync_weights(actor, self.version)

    def close(self, *, kill: bool = False) -> None:
        """Stop the generator. The batches asked for ahead of the run's end are drained unused."""
        if not self.client.closed and not kill:
            ahead = self.client.submitted - self.version + 1 - len(self._arrived)
            if ahead > 0:
                self.say(f"async rollout: stopping the generator; {ahead} batch(es) asked for ahead are drained unused")
        self.client.close(kill=kill)

    # -- inside ------------------------------------------------------------------------------------
    def _start(self, iteration: int, actor: nn.Module) -> None:
        if self.resumed and self.version != iteration:
            raise ValueError(f"async rollout: the checkpoint's weight version {self.version} is not the iteration it"
                             f" resumes at ({iteration})")
        self.version = iteration
        self.client.submitted = iteration - 1
        if self.resumed:
            self.say(f"async rollout: resumed at weight version {iteration}; the generator starts empty and its queue is"
                     f" rebuilt from iteration {iteration}'s prompts (samples in flight at the checkpoint were not saved)")
        self.client.sync_weights(actor, self.version)
        self._started = True

    def _submit(self, iteration: int, batch: dict[str, Any], *, rng_state: Tensor | None) -> None:
        ids, mask = batch["input_ids"], batch["attention_mask"]
        if self.group_size > 1:
            ids, mask = ids.repeat_interleave(self.group_size, dim=0), mask.repeat_interleave(self.group_size, dim=0)
        self._sent[iteration] = batch["input_ids"].cpu()
        rows = [row for row in batch["rows"] for _ in range(self.group_size)] if self.multi_turn else None
        self.client.submit(iteration, ids, mask, group_size=self.group_size, rng_state=rng_state,
                           greedy_baseline=self.greedy_baseline, rows=rows)

    def _check_same_prompts(self, iteration: int, batch: dict[str, Any]) -> None:
        sent = self._sent.pop(iteration)
        if not torch.equal(sent, batch["input_ids"].cpu()):
            raise RuntimeError(f"async rollout: the prompts sampled ahead for iteration {iteration} are not the ones the"
                               " loader gave it (the look-ahead and the loader disagree on the order)")

    def _take(self, iteration: int) -> tuple[int, list[Tensor]]:
        while iteration not in self._arrived:
            got, version, tensors = self.client.receive()
            self._arrived[got] = (version, tensors)
        return self._arrived.pop(iteration)


def _experience(tensors: list[Tensor], group_size: int) -> Experience:
    input_ids, attention_mask, prompt_lengths, response_ids, response_mask, behaviour = tensors[:_SAMPLES]
    n = input_ids.shape[0]
    return Experience(input_ids=input_ids, attention_mask=attention_mask, prompt_lengths=prompt_lengths,
                      response_ids=response_ids, response_mask=response_mask,
                      group_ids=torch.arange(n) // group_size, engine_logprobs=behaviour)
