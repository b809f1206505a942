"""Ranks of a really sharded run on CPU, and what FSDP2 does that the ledger must be told.

:func:`run_ranks` starts ``world_size`` processes (gloo, CPU tensors) that form one process group,
runs a function in each and gathers each rank's phases: :func:`~lightning_mem.estimate.measure_fit`
runs a config's own fit this way, to hold the estimate's per-rank figures (derived from one
unsharded process, :func:`~lightning_mem.estimate.sharding.shard_per_rank`) to what each rank holds.

:class:`FSDP2Categories` is what a :class:`~lightning_mem.estimate.recorder.PhaseRecorder` of an
FSDP2-sharded fit tells the ledger besides the operators' outputs, per rank:

* a ``DTensor`` counts as its local shard (parameters, gradients, optimizer state);
* FSDP2 gathers a unit into storages it allocates once and then resizes (to the full size
  before forward and backward, to zero after); those resizes are counted;
* categories: gathered parameters are ``weights``; unsharded gradients, the reduce-scatter
  buffers and the sharded gradients are ``gradients``; with ``cpu_offload`` everything FSDP2
  keeps on the host -- parameter and gradient shards, optimizer state, and the optimizer step
  with its gradient clipping, which run there -- is host memory, as on a GPU.

On a CPU-only machine nothing is copied between host and device, so what a GPU run with CPU
offload briefly holds twice (a shard copied up for its all-gather, a reduced gradient before its
copy down) is counted once.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.environments.lightning import find_free_network_port
from torch import nn

from lightning_mem.estimate.recorder import PhaseEstimate, in_section, patched
from lightning_mem.estimate.tracker import HOST

#: How long the ranks may take before they are stopped (a hang guard: the tiny model takes seconds).
DEFAULT_TIMEOUT_S = 1800.0


def run_ranks(target: Callable[..., list[PhaseEstimate]], args: tuple, *, world_size: int,
              timeout: float = DEFAULT_TIMEOUT_S, name: str = "ranks") -> list[list[PhaseEstimate]]:
    """``target(*args)`` in ``world_size`` spawned CPU processes that form one gloo process group;
    each rank's returned phases, by rank. A failed rank raises here with its traceback."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = find_free_network_port()
    with tempfile.TemporaryDirectory(prefix="lightning_mem_ranks_") as tmp:
        procs = [
            ctx.Process(target=_rank_main, args=(rank, world_size, port, target, args, tmp),
                        name=f"lightning_mem-rank{rank}")
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout
        try:
            for proc in procs:
                proc.join(max(deadline - time.monotonic(), 0.0))
        finally:
            hung = [proc for proc in procs if proc.is_alive()]
            for proc in hung:
                proc.terminate()
                proc.join(10)
        if hung:
            raise TimeoutError(f"{name}: ranks {[p.name for p in hung]} still ran after {timeout:.0f} s")
        failed = [(rank, proc.exitcode) for rank, proc in enumerate(procs) if proc.exitcode != 0]
        for rank, _ in failed:  # a bad setting or data line every rank meets: the first rank's, as it is
            user_error = Path(tmp) / f"rank{rank}.user_error"
            if user_error.is_file():
                raise pickle.loads(user_error.read_bytes())
        if failed:
            errors = [(Path(tmp) / f"rank{rank}.err") for rank, _ in failed]
            text = "\n".join(e.read_text() for e in errors if e.is_file())
            raise RuntimeError(f"{name}: ranks failed (rank, exit code) {failed}\n{text}")
        results = []
        for rank in range(world_size):
            phases = json.loads((Path(tmp) / f"rank{rank}.json").read_text())
            results.append([PhaseEstimate(**p) for p in phases])
    return results


#: A folder every spawned rank shares, removed by :func:`run_ranks` once all have exited. A rank
#: must not keep run files in a folder of its own: ranks write into rank 0's run folder
#: (``run_dir``), which would vanish when rank 0 finished first.
SHARED_DIR_ENV = "LIGHTNING_MEM_RANKS_DIR"


def _rank_main(rank: int, world_size: int, port: int, target: Callable[..., list[PhaseEstimate]], args: tuple,
               out: str) -> None:
    # The environment of an externally launched rank: Lightning then joins it instead of launching.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size), RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0", **{SHARED_DIR_ENV: out})
    torch.set_num_threads(1)  # the tiny model: more threads per rank only contend for the cores
    try:
        phases = target(*args, world_size=world_size)
        (Path(out) / f"rank{rank}.json").write_text(json.dumps([p.to_dict() for p in phases]))
    except BaseException as err:
        (Path(out) / f"rank{rank}.err").write_text(f"rank {rank}:\n{traceback.format_exc()}")
        # The recipes' user errors (lightning_mem.cli.USER_ERRORS), named here: the CLI imports the estimator.
        from lightning_mem.data.rows import DataFormatError
        from lightning_mem.settings import SettingError, user_error_in

        user_error = user_error_in(err, (SettingError, DataFormatError)) if isinstance(err, Exception) else None
        if user_error is not None:  # it pickles (settings.SettingError.__reduce__): the parent raises it
            (Path(out) / f"rank{rank}.user_error").write_bytes(pickle.dumps(user_error))
        raise
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class FSDP2Categories:
    """What a :class:`~lightning_mem.estimate.recorder.PhaseRecorder` of a really FSDP2-sharded fit
    tells the ledger: shards and gathered units, and, with ``cpu_offload``, the host.

    Mixed in before the recorder class; ``offload`` says whether the strategy offloads to the host.
    """

    offload: bool = False
    ledger: Any
    module: Any
    optimizers: list[Any]

    def _shard_category(self, category: str) -> str:
        return HOST if self.offload else category

    def retag(self) -> None:
        if self.module is None:
            return
        hooked = self.__dict__.setdefault("_hooked", set())
        ledger = self.ledger
        for p in self.module.parameters():  # DTensor shards: the ledger counts their local tensors
            ledger.retag(p, self._shard_category("weights"))
            if p.grad is not None:
                ledger.retag(p.grad, self._shard_category("gradients"))
        for b in self.module.buffers():
            ledger.retag(b, "weights")
        for fsdp_param in _fsdp_params(self.module):
            for t in fsdp_param.all_gather_outputs:  # the gathered parameter's storage (empty when resharded)
                ledger.retag(t, "weights")
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is not None and unsharded.requires_grad and id(unsharded) not in hooked:
                hooked.add(id(unsharded))
                unsharded.register_post_accumulate_grad_hook(lambda q: self.ledger.retag(q.grad, "gradients"))
        for opt in self.optimizers:
            self._retag_optimizer(opt)

    def _retag_optimizer(self, opt: Any) -> None:
        for state in opt.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    self.ledger.retag(value, self._shard_category("optimizer_state"))

    def _gradient_ready(self, param: torch.Tensor) -> None:
        # The hook the recorder put on each (sharded) parameter: FSDP2 calls it with the reduced shard.
        self.ledger.retag(param.grad, self._shard_category("gradients"))

    def _retag_sharded_grads(self, group: Any) -> None:
        for fsdp_param in group.fsdp_params:
            grad = fsdp_param.sharded_param.grad
            if grad is not None:
                self.ledger.retag(grad, self._shard_category("gradients"))

    # With CPU offload the optimizer step (and, in automatic optimization, the gradient clipping
    # before it) runs on the host shards: what it allocates is host memory.
    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        super().on_before_optimizer_step(trainer, pl_module, optimizer)  # type: ignore[misc]
        if self.offload:
            self.ledger.begin_section(HOST)

    def _stepped(self, opt: Any) -> None:
        super()._stepped(opt)  # type: ignore[misc]
        if self.offload:
            self.ledger.end_section(HOST)

    def accounting(self) -> contextlib.AbstractContextManager:
        return _fsdp_accounting(self)


def is_fsdp2(strategy: Any) -> bool:
    return strategy is not None and callable(getattr(strategy, "parallelize", None)) and hasattr(strategy, "cpu_offload")


@contextlib.contextmanager
def _fsdp_accounting(run: FSDP2Categories) -> Iterator[None]:
    """Tell the ledger what FSDP2 does out of the operators' sight, and what its buffers are.

    NOTE: these are torch's private FSDP2 modules (torch 2.13): the storage resizes that gather and
    free a unit, its post-backward, and its collectives. A measuring tool only, never the product's
    training path; a torch that renames the resize helpers or the post-backward fails here loudly
    (AttributeError) rather than measuring wrong; the collectives only name categories.
    """
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    ledger = run.ledger

    def resized(fn: Callable) -> Callable:
        def inner(tensor: torch.Tensor) -> None:
            fn(tensor)
            ledger.track(tensor)  # the ledger notices the storage's new size

        return inner

    def post_backward(fn: Callable) -> Callable:
        def inner(group: Any, *args: Any) -> Any:
            out = fn(group, *args)
            run._retag_sharded_grads(group)
            return out

        return inner

    with contextlib.ExitStack() as stack:
        for name in ("alloc_storage", "free_storage"):
            stack.enter_context(patched(_fsdp_param, name, resized))
        stack.enter_context(patched(_fsdp_param_group.FSDPParamGroup, "post_backward", post_backward))
        for name, category in (("foreach_all_gather", "weights"), ("foreach_all_gather_copy_out", "weights"),
                               ("foreach_reduce", "gradients")):
            if hasattr(_fsdp_param_group, name):
                stack.enter_context(patched(_fsdp_param_group, name, in_section(run.ledger, category)))
        yield


def _fsdp_params(module: nn.Module) -> list[Any]:
    """Every FSDP2 parameter record of ``module``'s units (its sharded and gathered tensors)."""
    from torch.distributed.fsdp import FSDPModule

    out = []
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            group = sub._get_fsdp_state()._fsdp_param_group
            if group is not None:
                out.extend(group.fsdp_params)
    return out
