"""Sharding arithmetic: how a strategy divides weights, gradients and optimizer state over ranks.

:func:`sharding_of` reads a strategy (FSDP2, with tensor and context parallelism; DeepSpeed ZeRO)
into a :class:`Sharding`; :func:`shard_per_rank` turns one unsharded measurement into one rank's
device breakdown and host bytes under it; :class:`MasterWeights` stands in for DeepSpeed's fp32
master copies. The run's moment-by-moment view of FSDP2's units (what is gathered, which gradients
are still unreduced) is :mod:`.rank_view`; really sharded ranks are :mod:`.sharded`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lightning_mem.estimate.tracker import MemoryLedger

@dataclass
class Sharding:
    """How a strategy divides weights, gradients and optimizer state over ranks, and offloads them."""

    name: str = "single device"
    shard: tuple[str, ...] = ()  # categories divided by the world size
    host: tuple[str, ...] = ()  # categories kept in host memory
    gathered_units: int = 0  # largest units held unsharded at once on the device (FSDP2/ZeRO-3)
    # In a forward, if more (0: as many): FSDP2 keeps a unit's flat all-gather output until the next
    # unit's is copied out (to overlap them), so beside the computing unit's parameters two flat
    # unit-sized buffers can be alive (measured on 2 gloo ranks: tests/estimate/test_estimate_accuracy.py).
    forward_gathered_units: int = 0
    # DeepSpeed ZeRO: the optimizer steps fp32 master copies of 16-bit weights (see
    # :class:`MasterWeights`), and gradients pass through reduce buckets of this many elements.
    master_weights: bool = False
    bucket_elements: int = 0
    # Gradients are reduce-scattered unit by unit as backward leaves each unit (FSDP2): until then a
    # unit's gradients are whole on the device, and its reduce-scatter input stays allocated until
    # the next unit reduces (see :class:`~lightning_mem.estimate.rank_view.GradientFlight`).
    unit_gradients: bool = False
    # FSDP2's mixed precision: units are gathered, and compute, in ``param_dtype``; gradients are
    # reduce-scattered in ``reduce_dtype`` (None: ``param_dtype``) onto shards of the parameters' own dtype.
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    # FSDP2's reshard_after_forward: True frees a unit after its forward; False keeps a trained
    # model's units gathered from their forward until their backward; an int k keeps a 1/k copy.
    reshard_after_forward: bool | int = True
    # FSDP2Strategy's tensor and context parallelism (lightning_mem/strategies/tensor_parallel.py,
    # lightning_mem/context_parallel.py). Weights, gradients and optimizer state stay 1/world_size
    # per rank: the plan splits every layer, embeddings and output layer included, over the
    # tensor-parallel ranks, and FSDP2 shards those pieces over the data x context ranks (the
    # replicated norms are ignored). What FSDP2 gathers, and the gradients it has yet to reduce, are
    # a unit's tensor-parallel piece: 1/tensor_parallel. Outside generation each rank runs
    # 1/context_parallel of every sequence: activations and logits divide by it (Ulysses trades the
    # attention kernel's sequence for heads: the same bytes); with ``sequence_parallel`` the
    # activations divide by the tensor-parallel size too (heads and MLP columns inside the regions,
    # sequence shards between them); without it they are counted whole (an upper bound: the local
    # heads and columns would be smaller). The logits are whole over the vocabulary (the output
    # layer gathers them). Generation runs whole sequences on every rank of a context group, through
    # the split model: its KV cache holds 1/tensor_parallel of the key/value heads.
    tensor_parallel: int = 1
    context_parallel: int = 1
    sequence_parallel: bool = False


def sharding_of(strategy: Any) -> Sharding:
    if strategy is None:
        return Sharding()
    name = type(strategy).__name__
    if hasattr(strategy, "_cpu_offload") and hasattr(strategy, "_reshard_after_forward"):  # FSDP2Strategy
        cats = ("weights", "gradients", "optimizer_state")
        reshard = strategy._reshard_after_forward
        precision = f", compute in {str(strategy._param_dtype).removeprefix('torch.')}" if strategy._param_dtype else ""
        tp, cp = getattr(strategy, "tensor_parallel_size", 1), getattr(strategy, "context_parallel_size", 1)
        sp = getattr(strategy, "sequence_parallel", False)
        split = (f" + TP {tp}" + (" (sequence parallel)" if sp else "") if tp > 1 else "") + (f" + CP {cp}" if cp > 1 else "")
        return Sharding("FSDP2" + split + (" + CPU offload" if strategy.cpu_offload else "") + precision, cats,
                        cats if strategy.cpu_offload else (), gathered_units=2, forward_gathered_units=3,
                        unit_gradients=True, param_dtype=strategy._param_dtype, reduce_dtype=strategy._reduce_dtype,
                        reshard_after_forward=reshard, tensor_parallel=tp, context_parallel=cp, sequence_parallel=sp)
    tier = getattr(strategy, "tier", None)
    if tier is not None:  # ZeroStrategy
        shard = ("gradients", "optimizer_state") + (("weights",) if tier.stage == 3 else ())
        # With the optimizer offloaded, each rank's reduced gradient partition goes to the host too,
        # where CPU Adam steps it; only the reduce buckets stay on the device.
        host = (("gradients", "optimizer_state") if tier.offloads_optimizer else ()) + (
            ("weights",) if tier.offloads_params else ())
        # Stage 2 with overlap_comm alternates two reduce buckets; stage 3 keeps one.
        buckets = 2 if tier.stage == 2 and tier.overlap_comm else 1
        return Sharding(f"DeepSpeed ZeRO-{tier.stage}" + (" + offload" if host else ""), shard, host,
                        gathered_units=2 if tier.stage == 3 else 0, master_weights=True,
                        bucket_elements=buckets * tier.reduce_bucket_size)
    return Sharding(name)


def shard_per_rank(breakdown: dict[str, int], host: int, sharding: Sharding, world_size: int,
                   unit_bytes: tuple[int, int], grad_element_size: int = 4, *, gathered: bool = True,
                   in_flight: tuple[int, int] | None = None,
                   gathered_units: int | None = None, scales: dict[str, float] | None = None,
                   resident: int = 0, generating: bool = False) -> tuple[dict[str, int], int]:
    """Per-rank device breakdown and host bytes of one unsharded measurement under ``sharding``.

    A sharded category holds 1/world_size of its measured bytes per rank (on the host when
    offloaded). A strategy that shards parameters gathers units (a decoder block, the root) to
    compute: ``gathered_units`` of the largest block plus the root unit stay on the device, with
    their gradients before the reduce-scatter (``unit_bytes`` = (largest block, root) parameter bytes).
    ``gathered=False``: the optimizer step, where no unit is gathered and no gradient is in flight.
    ``in_flight`` (with ``sharding.unit_gradients``): the measured gradients not reduced yet (whole
    on the device, not sharded) and the reduce-scatter buffer held beside them; ``gathered_units``
    overrides the sharding's count of gathered blocks (1 in a model's last block of backward).
    DeepSpeed's reduce buckets (``bucket_elements`` of ``grad_element_size`` bytes, no more than the
    gradients) stay on the device; a gradient partition it offloads is fp32 on the host.
    ``scales``: per category, the sharded bytes per measured byte (the run computed in FSDP2's
    ``param_dtype`` while the shards keep their own dtype: fp32 shards of a bf16 computation are 2).
    ``resident``: bytes of units a ``reshard_after_forward`` other than True keeps after their forward.
    Tensor and context parallelism divide as :class:`Sharding` says; ``generating``: the rollout's
    generation, which runs whole sequences on every rank of a context group.
    """
    measured_grads = breakdown["gradients"]
    out = dict(breakdown)
    unreduced, buffered = in_flight if in_flight is not None and gathered else (0, 0)
    scales = scales or {}
    for cat in sharding.shard:
        measured = breakdown[cat] - (unreduced if cat == "gradients" else 0)
        share = math.ceil(measured * scales.get(cat, 1.0) / world_size)
        if cat in sharding.host:
            out[cat] = 0
            host += share * 4 // grad_element_size if cat == "gradients" and sharding.master_weights else share
        else:
            out[cat] = share
    if "weights" in sharding.shard and sharding.gathered_units and gathered:
        block, root = unit_bytes
        units = sharding.gathered_units if gathered_units is None else gathered_units
        tp = sharding.tensor_parallel  # a gathered unit is its tensor-parallel piece
        out["weights"] += math.ceil((min(units * block + root, breakdown["weights"]) + resident) / tp)
        if in_flight is not None:
            out["gradients"] += math.ceil((unreduced + buffered * scales.get("reduce_scatter", 1.0)) / tp)
        elif breakdown["gradients"]:
            out["gradients"] += math.ceil(min(block + root, breakdown["gradients"]) / tp)
    if sharding.tensor_parallel * sharding.context_parallel > 1:
        if generating:
            out["kv_cache"] = math.ceil(out["kv_cache"] / sharding.tensor_parallel)
        else:
            tokens = sharding.context_parallel
            out["logits"] = math.ceil(out["logits"] / tokens)
            out["activations"] = math.ceil(
                out["activations"] / (tokens * (sharding.tensor_parallel if sharding.sequence_parallel else 1)))
    if sharding.bucket_elements and measured_grads:
        out["gradients"] += min(sharding.bucket_elements * grad_element_size, measured_grads)
    return out, host


class MasterWeights:
    """DeepSpeed ZeRO's mixed-precision optimizer, as far as memory goes.

    Beside 16-bit weights DeepSpeed keeps an fp32 master copy of every trainable parameter; at
    the step it gives the masters fp32 copies of the gradients, steps the client optimizer (or
    CPU Adam, which allocates the same two fp32 moments) on them, and copies the masters back into
    the 16-bit weights. Here the client optimizer's own class steps fp32 copies made the same way,
    so the state bytes are whatever that optimizer allocates; the strategy's sharding then divides
    them per rank (:func:`shard_per_rank`). fp32 weights need no master copy: the optimizer is
    returned as it is.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, pairs: list[tuple[torch.Tensor, torch.Tensor]],
                 ledger: MemoryLedger) -> None:
        self.optimizer = optimizer
        self.pairs = pairs
        self.ledger = ledger

    @classmethod
    def wrap(cls, optimizer: torch.optim.Optimizer, ledger: MemoryLedger) -> Any:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if all(p.dtype == torch.float32 for p in params):
            return optimizer
        pairs, groups = [], []
        with ledger.section("optimizer_state"), torch.no_grad():
            for group in optimizer.param_groups:
                masters = [p.detach().float().requires_grad_(p.requires_grad) for p in group["params"]]
                pairs += zip(group["params"], masters)
                groups.append({**group, "params": masters})
        return cls(type(optimizer)(groups), pairs, ledger)  # every group names all its hyperparameters

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def register_step_post_hook(self, hook: Callable) -> Any:
        return self.optimizer.register_step_post_hook(hook)

    @torch.no_grad()
    def step(self, closure: Callable | None = None) -> None:
        if closure is not None:  # Lightning's automatic optimization: the forward and backward
            with torch.enable_grad():
                closure()
        # Everything the step allocates, its temporaries included, belongs to the rank's partition.
        with self.ledger.section("optimizer_state"):
            for param, master in self.pairs:
                if param.grad is not None:
                    master.grad = param.grad.float()
                    param.grad = None  # DeepSpeed frees the 16-bit gradient partition at the step
            self.optimizer.step()
        for param, master in self.pairs:
            param.copy_(master)
            master.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param, _ in self.pairs:
            param.grad = None
