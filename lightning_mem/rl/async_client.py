"""The training ranks' side of separate placement: start the generators, feed them, take their samples.

Launch: training rank 0 spawns the generator processes (``model.async_rollout.generator_devices``
of them; ``torch.multiprocessing``, spawn start) and every training rank joins a rollout group with
them (:mod:`lightning_mem.rl.rollout_link`). One command starts the run, under any launcher
Lightning supports, and Lightning's own world stays the training world: its collectives, samplers
and checkpoints are unchanged. Each training rank's requests go to one generator
(:func:`~lightning_mem.rl.async_generator.served_by`); rank 0 talks to all of them.

Per iteration ``t`` a training rank: sends the prompts of iterations up to ``t + k`` ahead
(:meth:`AsyncRolloutClient.submit`), receives iteration ``t``'s samples with the version they were
sampled under (:meth:`receive`), trains, and every ``weight_sync_steps`` takes part in the weight
sync (:meth:`sync_weights`): the bucketed walk of :mod:`lightning_mem.rl.weight_sync` (LoRA merged,
at most one bucket of converted tensors alive) runs on every training rank when the weights are
sharded (FSDP2 gathers each tensor collectively), and rank 0 sends each bucket to every generator.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from collections.abc import Iterator
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn

from lightning_mem.rl import rollout_link as rl
from lightning_mem.rl.async_generator import GeneratorSpec, run_generator, served_by
from lightning_mem.rl.weight_sync import checkpoint_weights, is_sharded, weight_buckets

_MAX_TENSORS_A_MESSAGE = 15  # a header names at most 16 tensors: the names, then 15 weights


class AsyncRolloutClient:
    """One training rank's end of the rollout group.

    Args:
        spec: the generators' settings (rank 0 starts them with it; ``host``/``port`` are filled here).
        rank, world_size: this rank among the training ranks, and their number.
        broadcast: rank 0's object to every training rank (the strategy's ``broadcast``).
        bucket_mb: the weight sync's bucket size.
        sync_dtype: the dtype the generator holds its weights in.
    """

    def __init__(self, spec: GeneratorSpec, *, rank: int = 0, world_size: int = 1,
                 broadcast: Callable[[Any], Any] = lambda obj: obj, bucket_mb: int = 256,
                 sync_dtype: torch.dtype | None = None) -> None:
        self.spec, self.rank, self.world_size = spec, rank, world_size
        self.broadcast, self.bucket_bytes, self.sync_dtype = broadcast, bucket_mb * 2**20, sync_dtype
        self.processes: list[Any] = []  # rank 0's generator processes, by index
        self.links: dict[int, rl.Link] = {}  # generator index -> link (rank 0: all; others: their own)
        self.link: rl.Link | None = None  # to the generator that samples this rank's requests
        self._sends: list = []  # requests sent and not yet waited (their buffers kept alive)
        self.submitted = -1  # the last iteration whose prompts went out
        self.closed = False

    @property
    def process(self) -> Any:
        """The generator process that samples this rank's requests (rank 0's only; None elsewhere)."""
        return self.processes[served_by(self.rank, self.spec.generators)] if self.processes else None

    @property
    def generators(self) -> int:
        return self.spec.generators

    def generator_rank(self, index: int) -> int:
        return self.world_size + index

    def describe(self, index: int | None = None) -> str:
        """A generator, as an error names it: pid and, once it has exited, its exit code."""
        index = served_by(self.rank, self.generators) if index is None else index
        name = "the generator" if self.generators == 1 else f"generator {index}"
        if not self.processes:
            return f"async rollout: {name} (rank {self.generator_rank(index)} of the rollout group)"
        process = self.processes[index]
        process.join(timeout=2.0)  # a generator that just died is reaped, so its exit code shows
        code = process.exitcode
        state = "still running" if code is None else f"exited with code {code}"
        return f"async rollout: {name} process (pid {process.pid}, {state})"

    def start(self) -> None:
        """Rank 0 spawns the generators; every training rank joins the rollout group."""
        spec, size = self.spec, self.world_size + self.generators
        if spec.world_size != size:
            raise ValueError(f"async rollout: the generators' spec counts {spec.world_size} ranks, the run has"
                             f" {self.world_size} training ranks and {self.generators} generator(s)")
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        startup = datetime.timedelta(seconds=rl.STARTUP_S)
        store = None
        if self.rank == 0:
            store = dist.TCPStore(spec.host, 0, size, is_master=True, timeout=max(timeout, startup), wait_for_workers=False)
            spec.port = store.port
            for index in range(self.generators):
                process = mp.get_context("spawn").Process(
                    target=run_generator, args=(dataclasses.replace(spec, index=index),), daemon=True,
                    name=f"lightning_mem-generator-{index}")
                process.start()
                self.processes.append(process)
        spec.port = self.broadcast(spec.port)
        if store is None:
            store = dist.TCPStore(spec.host, spec.port, size, is_master=False, timeout=max(timeout, startup))
        self._store = store  # the master's store must outlive the group
        group = rl.open_group(store, self.rank, size, max(spec.timeout_s, rl.STARTUP_S))
        mine = served_by(self.rank, self.generators)
        for index in range(self.generators) if self.rank == 0 else [mine]:
            self.links[index] = rl.Link(group, self.generator_rank(index), spec.timeout_s,
                                        lambda index=index: self.describe(index))
        self.link = self.links[mine]
        # A generator loads its copy of the actor before it says so: that may take longer than a step.
        for index, link in self.links.items():
            kind, *_ = link.recv(tag=rl.SAMPLES, what="starting (loading its copy of the actor)",
                                 timeout_s=max(spec.timeout_s, rl.STARTUP_S))
            if kind != rl.READY:
                raise rl.LinkLost(f"{self.describe(index)} sent a message of kind {kind} before saying it was ready")

    # -- traffic ---------------------------------------------------------------------------------
    def submit(self, iteration: int, prompt_ids: Tensor, prompt_mask: Tensor, *, group_size: int = 1,
               rng_state: Tensor | None = None, greedy_baseline: bool = False,
               rows: list[dict[str, Any]] | None = None) -> None:
        """Send iteration ``iteration``'s prompts (with an environment, their data rows; and, to sample
        in lockstep, the trainer's random state); ``greedy_baseline``: ask for one greedy answer per
        row too (ReMax)."""
        tensors = [prompt_ids.cpu(), prompt_mask.cpu()] + ([rl.json_tensor(rows)] if rows is not None else [])
        tensors += [rng_state] if rng_state is not None else []
        number = rl.request_number(group_size, greedy_baseline)
        self._sends += self.link.isend(rl.REQUEST, iteration, number, tensors, tag=rl.CONTROL,
                                       what=f"sending the prompts of iteration {iteration}")
        self.submitted = max(self.submitted, iteration)

    def _flush(self) -> None:
        self.link.wait_all(self._sends, "sending prompts")
        self._sends = []

    def receive(self) -> tuple[int, int, list[Tensor]]:
        """The next batch of samples the generator sent: its iteration, the weight version it was
        sampled under, and ``input_ids, attention_mask, prompt_lengths, response_ids, response_mask,
        behaviour logprobs`` (then the greedy answers' response ids and lengths, if asked for, and the
        random state after sampling, in lockstep)."""
        kind, iteration, version, tensors = self.link.recv(tag=rl.SAMPLES, what="waiting for samples")
        if kind != rl.SAMPLE_BATCH:
            raise rl.LinkLost(f"{self.describe()} sent a message of kind {kind} where samples were due")
        self._flush()
        return iteration, version, tensors

    @torch.no_grad()
    def sync_weights(self, actor: nn.Module, version: int) -> int:
        """Send the actor's weights as version ``version`` to every generator, one bucket at a time;
        the bytes sent to one generator.

        Rank 0 sends. Sharded weights (FSDP2's DTensors) are gathered tensor by tensor, a collective:
        every training rank walks them in the same order and drops each gathered bucket."""
        if self.rank != 0 and not is_sharded(actor):
            return 0
        what = f"sending the weights of version {version}"
        links = list(self.links.values()) if self.rank == 0 else []
        for link in links:
            link.send(rl.WEIGHT_UPDATE, version, 0, [], tag=rl.CONTROL, what=what)
        sent = 0
        for names, tensors in weight_messages(actor, bucket_bytes=self.bucket_bytes, dtype=self.sync_dtype):
            message = [rl.names_tensor(names), *tensors]
            for link in links:
                link.send(rl.WEIGHT_UPDATE, version, 0, message, tag=rl.WEIGHTS, what=what)
            sent += sum(t.numel() * t.element_size() for t in tensors)
            del message, tensors  # handed over: the walk converts the next bucket only now
        for link in links:
            link.send(rl.WEIGHT_UPDATE, version, 1, [rl.names_tensor([])], tag=rl.WEIGHTS, what=what)  # the end
        return sent if self.rank == 0 else 0

    def close(self, *, kill: bool = False) -> None:
        """Stop the generator: ask it (it drains the requests made ahead), or kill it after a failure."""
        if self.closed:
            return
        self.closed = True
        if not kill and self.links:
            try:
                self._flush()
                for link in self.links.values():
                    link.send(rl.STOP, 0, 0, [], tag=rl.CONTROL, what="stopping the generator")
            except rl.LinkLost:
                kill = True
        for process in self.processes:
            process.join(timeout=0 if kill else self.spec.timeout_s)
            if kill or process.is_alive():
                process.kill()
                process.join(timeout=10)


def weight_messages(actor: nn.Module, *, bucket_bytes: int, dtype: torch.dtype | None = None,
                    ) -> Iterator[tuple[list[str], list[Tensor]]]:
    """The weight sync's messages: ``(names, tensors)`` of at most 15 host tensors each, bucket by
    bucket of :func:`~lightning_mem.rl.weight_sync.weight_buckets` (what a generator receives at a
    time; the memory estimate counts its receive buffers from these)."""
    for bucket in weight_buckets(checkpoint_weights(actor), max_bytes=bucket_bytes, dtype=dtype, device="cpu"):
        for start in range(0, len(bucket), _MAX_TENSORS_A_MESSAGE):
            chunk = bucket[start: start + _MAX_TENSORS_A_MESSAGE]
            yield [n for n, _ in chunk], [t for _, t in chunk]
            del chunk
        del bucket


def default_host() -> str:
    """Where the generator's rollout group meets: rank 0's address under a launcher, else this host."""
    return os.environ.get("MASTER_ADDR", "127.0.0.1")
