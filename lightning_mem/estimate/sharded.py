"""The estimator's step really sharded: one CPU process per rank, each counting its own bytes.

:func:`~lightning_mem.estimate.estimate` runs a sharding strategy as one unsharded process and
derives each rank's bytes (:func:`~lightning_mem.estimate.session.shard_per_rank`). This module
checks that derivation against the real thing: :func:`measure_sharded` starts ``world_size``
processes (gloo, on CPU tensors), and each rank takes the estimator's own steps -- the recipe's
``configure_model``, the optimizers, the warm-up step, the largest micro-batch -- with the model
sharded by the config's :class:`~lightning_mem.strategies.FSDP2Strategy` exactly as its
``setup`` shards it for a run (``setup_environment``, ``parallelize``, ``model_to_device``), under
the same :class:`~lightning_mem.estimate.tracker.MemoryLedger` and
:class:`~lightning_mem.estimate.tracker.TrackingMode`. Each rank reports its own per-phase peak.

What the ledger learns besides the operators' outputs, per rank:

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
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.environments.lightning import find_free_network_port
from torch import nn

from lightning_mem.estimate.session import HOST, EstimateRun, PhaseEstimate, Sharding, estimate, in_section, patched

#: How long the ranks may take before they are stopped (a hang guard: the tiny model takes seconds).
DEFAULT_TIMEOUT_S = 1800.0


def measure_sharded(
    config: str | Path,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    world_size: int = 2,
    recipe: str | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> list[list[PhaseEstimate]]:
    """Each rank's phases of ``config`` (plus ``overrides``), really sharded over ``world_size``
    CPU processes on real tensors: ``result[rank]`` is that rank's list of phases.

    For small models (the tiny test model): every rank builds the whole model before sharding it.
    The ranks are started with ``multiprocessing``'s spawn method, so a script calling this must
    guard its top level with ``if __name__ == "__main__":``. A rank that fails makes this raise
    with that rank's traceback; ranks still running after ``timeout`` seconds are stopped.
    """
    import torch.multiprocessing as mp

    if world_size < 2:
        raise ValueError(f"`world_size`: a sharded measurement needs at least 2 ranks, got {world_size}")
    ctx = mp.get_context("spawn")
    port = find_free_network_port()
    with tempfile.TemporaryDirectory(prefix="lightning_mem_sharded_") as tmp:
        procs = [
            ctx.Process(target=_rank_main, args=(rank, world_size, port, str(config), list(overrides), recipe, tmp),
                        name=f"lightning_mem-sharded-rank{rank}")
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
            names = [p.name for p in hung]
            raise TimeoutError(f"measure_sharded({config}): ranks {names} still ran after {timeout:.0f} s")
        failed = [(rank, proc.exitcode) for rank, proc in enumerate(procs) if proc.exitcode != 0]
        if failed:
            errors = [(Path(tmp) / f"rank{rank}.err") for rank, _ in failed]
            text = "\n".join(e.read_text() for e in errors if e.is_file())
            raise RuntimeError(f"measure_sharded({config}): ranks failed (rank, exit code) {failed}\n{text}")
        results = []
        for rank in range(world_size):
            phases = json.loads((Path(tmp) / f"rank{rank}.json").read_text())
            results.append([PhaseEstimate(**p) for p in phases])
    return results


def _rank_main(rank: int, world_size: int, port: int, config: str, overrides: list[str], recipe: str | None,
               out: str) -> None:
    # The environment of an externally launched rank: Lightning then joins it instead of launching.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size), RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0")
    torch.set_num_threads(1)  # the tiny model: more threads per rank only contend for the cores
    try:
        result = estimate(config, overrides, recipe=recipe, world_size=world_size, fake=False,
                          run_class=ShardedRun)
        (Path(out) / f"rank{rank}.json").write_text(json.dumps([p.to_dict() for p in result.phases]))
    except BaseException:
        (Path(out) / f"rank{rank}.err").write_text(f"rank {rank}:\n{traceback.format_exc()}")
        raise
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class ShardedRun(EstimateRun):
    """The estimator's run with the model really sharded by the config's FSDP2Strategy, on this rank."""

    def __init__(self, init: Any, cfg: Any, *, world_size: int, fake: bool, vocab: list[int], workdir: Path) -> None:
        from lightning.pytorch import Trainer

        if fake:
            raise ValueError("a sharded measurement runs on real tensors (fake=False)")
        super().__init__(init, cfg, world_size=world_size, fake=fake, vocab=vocab, workdir=workdir)
        strategy = self.strategy
        if strategy is None or not callable(getattr(strategy, "parallelize", None)):
            raise ValueError(
                f"`trainer.strategy`: a sharded measurement needs lightning_mem.strategies.FSDP2Strategy, "
                f"found {type(strategy).__name__ if strategy is not None else cfg.trainer.strategy!r}"
            )
        self.offload = bool(strategy.cpu_offload)
        # Measured per rank: nothing is left to derive.
        self.sharding = Sharding(f"{self.sharding.name}, measured on {world_size} ranks")
        # The trainer this rank's strategy belongs to, as in a real run (`devices` CPU processes,
        # launched outside Lightning: the environment names this rank).
        self.trainer = Trainer(accelerator="cpu", devices=world_size, strategy=strategy, logger=False,
                               enable_checkpointing=False, default_root_dir=str(workdir), enable_progress_bar=False,
                               enable_model_summary=False, callbacks=self.callbacks)
        strategy.connect(self.module)
        strategy.setup_environment()  # the process group and the device mesh
        self._hooked: set[int] = set()

    # -- building: what FSDP2Strategy.setup does between configure_model and the optimizers --------
    def _checkpointing(self) -> None:
        self.strategy.parallelize(self.module)  # activation checkpointing, fully_shard per block, root
        self.strategy.model_to_device()

    # -- categories ----------------------------------------------------------------------------
    def _shard_category(self, category: str) -> str:
        return HOST if self.offload else category

    def retag(self) -> None:
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
            if unsharded is not None and unsharded.requires_grad and id(unsharded) not in self._hooked:
                self._hooked.add(id(unsharded))
                unsharded.register_post_accumulate_grad_hook(lambda q: self.ledger.retag(q.grad, "gradients"))
        for opt in self.optimizers:
            self._retag_optimizer(opt)

    def _retag_optimizer(self, opt: torch.optim.Optimizer) -> None:
        for state in opt.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    self.ledger.retag(value, self._shard_category("optimizer_state"))

    def _gradient_ready(self, param: torch.Tensor) -> None:
        # The hook the run put on each (sharded) parameter: FSDP2 calls it with the reduced shard.
        self.ledger.retag(param.grad, self._shard_category("gradients"))

    def _retag_sharded_grads(self, group: Any) -> None:
        for fsdp_param in group.fsdp_params:
            grad = fsdp_param.sharded_param.grad
            if grad is not None:
                self.ledger.retag(grad, self._shard_category("gradients"))

    # -- the step ------------------------------------------------------------------------------
    def step_optimizers(self) -> None:
        # With CPU offload the optimizer step (and the gradient clipping before it) runs on the
        # host shards: what it allocates is host memory.
        with self.ledger.section(HOST) if self.offload else contextlib.nullcontext():
            super().step_optimizers()

    def accounting(self) -> contextlib.AbstractContextManager:
        return _fsdp_accounting(self)


@contextlib.contextmanager
def _fsdp_accounting(run: ShardedRun) -> Iterator[None]:
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
