"""The training ranks' side of separate placement: start the generator, feed it, take its samples.

Launch: training rank 0 spawns one generator process (``torch.multiprocessing``, spawn start) and
every training rank joins a rollout group with it (:mod:`lightning_mem.rl.rollout_link`). One
command starts the run, under any launcher Lightning supports, and Lightning's own world stays the
training world: its collectives, samplers and checkpoints are unchanged.

Per iteration ``t`` a training rank: sends the prompts of iterations up to ``t + k`` ahead
(:meth:`AsyncRolloutClient.submit`), receives iteration ``t``'s samples with the version they were
sampled under (:meth:`receive`), trains, and (rank 0, every ``weight_sync_steps``) sends the new
weights (:meth:`sync_weights`) through the bucketed walk of :mod:`lightning_mem.rl.weight_sync`: LoRA
merged, at most one bucket of converted tensors alive.
"""

from __future__ import annotations

import datetime
import os
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn

from lightning_mem.rl import rollout_link as rl
from lightning_mem.rl.async_generator import GeneratorSpec, run_generator
from lightning_mem.rl.weight_sync import checkpoint_weights, weight_buckets

_MAX_TENSORS_A_MESSAGE = 15  # a header names at most 16 tensors: the names, then 15 weights


class AsyncRolloutClient:
    """One training rank's end of the rollout group.

    Args:
        spec: the generator's settings (rank 0 starts it with them; ``host``/``port`` are filled here).
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
        self.process: Any = None
        self.link: rl.Link | None = None
        self._sends: list = []  # requests sent and not yet waited (their buffers kept alive)
        self.submitted = -1  # the last iteration whose prompts went out
        self.closed = False

    @property
    def generator_rank(self) -> int:
        return self.world_size

    def describe(self) -> str:
        """The generator, as an error names it: pid and, once it has exited, its exit code."""
        if self.process is None:
            return f"async rollout: the generator (rank {self.generator_rank} of the rollout group)"
        self.process.join(timeout=2.0)  # a generator that just died is reaped, so its exit code shows
        code = self.process.exitcode
        state = "still running" if code is None else f"exited with code {code}"
        return f"async rollout: the generator process (pid {self.process.pid}, {state})"

    def start(self) -> None:
        """Rank 0 spawns the generator; every training rank joins the rollout group."""
        spec, size = self.spec, self.world_size + 1
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        startup = datetime.timedelta(seconds=rl.STARTUP_S)
        store = None
        if self.rank == 0:
            store = dist.TCPStore(spec.host, 0, size, is_master=True, timeout=max(timeout, startup), wait_for_workers=False)
            spec.port = store.port
            self.process = mp.get_context("spawn").Process(target=run_generator, args=(spec,), daemon=True,
                                                           name="lightning_mem-generator")
            self.process.start()
        spec.port = self.broadcast(spec.port)
        if store is None:
            store = dist.TCPStore(spec.host, spec.port, size, is_master=False, timeout=max(timeout, startup))
        self._store = store  # the master's store must outlive the group
        group = rl.open_group(store, self.rank, size, max(spec.timeout_s, rl.STARTUP_S))
        self.link = rl.Link(group, self.generator_rank, spec.timeout_s, self.describe)
        # The generator loads its copy of the actor before it says so: that may take longer than a step.
        kind, *_ = self.link.recv(tag=rl.SAMPLES, what="starting (loading its copy of the actor)",
                                  timeout_s=max(spec.timeout_s, rl.STARTUP_S))
        if kind != rl.READY:
            raise rl.LinkLost(f"{self.describe()} sent a message of kind {kind} before saying it was ready")

    # -- traffic ---------------------------------------------------------------------------------
    def submit(self, iteration: int, prompt_ids: Tensor, prompt_mask: Tensor, *, group_size: int = 1,
               rng_state: Tensor | None = None) -> None:
        """Send iteration ``iteration``'s prompts (and, to sample in lockstep, the trainer's random state)."""
        tensors = [prompt_ids.cpu(), prompt_mask.cpu()] + ([rng_state] if rng_state is not None else [])
        self._sends += self.link.isend(rl.REQUEST, iteration, group_size, tensors, tag=rl.CONTROL,
                                       what=f"sending the prompts of iteration {iteration}")
        self.submitted = max(self.submitted, iteration)

    def _flush(self) -> None:
        self.link.wait_all(self._sends, "sending prompts")
        self._sends = []

    def receive(self) -> tuple[int, int, list[Tensor]]:
        """The next batch of samples the generator sent: its iteration, the weight version it was
        sampled under, and ``input_ids, attention_mask, prompt_lengths, response_ids, response_mask,
        behaviour logprobs`` (and the random state after sampling, in lockstep)."""
        kind, iteration, version, tensors = self.link.recv(tag=rl.SAMPLES, what="waiting for samples")
        if kind != rl.SAMPLE_BATCH:
            raise rl.LinkLost(f"{self.describe()} sent a message of kind {kind} where samples were due")
        self._flush()
        return iteration, version, tensors

    @torch.no_grad()
    def sync_weights(self, actor: nn.Module, version: int) -> int:
        """Rank 0: send the actor's weights as version ``version``, one bucket at a time; the bytes sent."""
        if self.rank != 0:
            return 0
        what = f"sending the weights of version {version}"
        self.link.send(rl.WEIGHT_UPDATE, version, 0, [], tag=rl.CONTROL, what=what)
        sent = 0
        for bucket in weight_buckets(checkpoint_weights(actor), max_bytes=self.bucket_bytes, dtype=self.sync_dtype,
                                     device="cpu"):
            for start in range(0, len(bucket), _MAX_TENSORS_A_MESSAGE):
                chunk = bucket[start: start + _MAX_TENSORS_A_MESSAGE]
                self.link.send(rl.WEIGHT_UPDATE, version, 0, [_names(n for n, _ in chunk), *(t for _, t in chunk)],
                               tag=rl.WEIGHTS, what=what)
                sent += sum(t.numel() * t.element_size() for _, t in chunk)
            del bucket  # handed over: the walk converts the next one only now
        self.link.send(rl.WEIGHT_UPDATE, version, 1, [_names([])], tag=rl.WEIGHTS, what=what)  # the end
        return sent

    def close(self, *, kill: bool = False) -> None:
        """Stop the generator: ask it (it drains the requests made ahead), or kill it after a failure."""
        if self.closed:
            return
        self.closed = True
        if not kill and self.link is not None:
            try:
                self._flush()
                self.link.send(rl.STOP, 0, 0, [], tag=rl.CONTROL, what="stopping the generator")
            except rl.LinkLost:
                kill = True
        if self.process is not None:
            self.process.join(timeout=0 if kill else self.spec.timeout_s)
            if kill or self.process.is_alive():
                self.process.kill()
                self.process.join(timeout=10)


def _names(names: Any) -> Tensor:
    return torch.tensor(list("\n".join(names).encode()), dtype=torch.uint8)


def default_host() -> str:
    """Where the generator's rollout group meets: rank 0's address under a launcher, else this host."""
    return os.environ.get("MASTER_ADDR", "127.0.0.1")
