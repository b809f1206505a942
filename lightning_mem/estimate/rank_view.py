"""The per-rank view of an unsharded run: which of FSDP2's units are gathered, which gradients are
still unreduced, and what tensor and context parallelism leave each rank, at every allocation.

The estimate runs a sharded config as one unsharded process. :class:`RankView` (a
:class:`~lightning_mem.estimate.recorder.PhaseRecorder`) gives its ledger a view that turns each
moment's unsharded bytes into one rank's (:func:`~lightning_mem.estimate.sharding.shard_per_rank`),
so a rank peaks where its own bytes do, not where the unsharded process does; gradients are
followed unit by unit as FSDP2 reduce-scatters them (:class:`GradientFlight`), and each model's
root unit is gathered only while that model runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from typing_extensions import override

from lightning_mem.estimate.recorder import PhaseRecorder
from lightning_mem.estimate.sharding import Sharding, shard_per_rank
from lightning_mem.estimate.tracker import MemoryLedger


@dataclass
class RootFlight:
    """One FSDP2 root's (one model's) gradients not reduce-scattered yet, and its buffer."""

    root: int = 0  # gradients of the root unit (outside the blocks) so far: reduced at the end of backward
    current: int | None = None  # the block whose gradients arrive now
    current_bytes: int = 0
    buffered: int = 0  # the last reduced block's reduce-scatter input


@dataclass
class GradientFlight:
    """FSDP2's gradients on their way to the reduce-scatter, followed through one backward.

    FSDP2 reduce-scatters a unit's gradients when backward leaves the unit: until then they are
    whole (unsharded) on the device. Its reduce-scatter input, a unit-sized buffer, stays
    allocated until the next unit of the same root reduces (FSDP2 keeps one in flight per root,
    so the collective may overlap the next unit's compute); the root units (embeddings, final
    norm, head: everything outside the blocks) reduce at the end of backward. Each model is its
    own root (PPO's actor and critic backpropagate in one backward, each with its own buffer).
    Fed by each parameter's gradient as the unsharded run accumulates it, and by the gradient of
    each block's input, which is when backward leaves the block (FSDP2 hooks the same moment) --
    before the previous block's recomputation, whose activations must not meet this block's
    gradients twice over.
    """

    unit_of: dict[int, tuple[int, int | None]] = field(default_factory=dict)  # id(param) -> (root, id(block) | None)
    unit_bytes: dict[int, int] = field(default_factory=dict)  # id(block) -> its trainable parameters' bytes
    index: dict[int, tuple[int, int]] = field(default_factory=dict)  # id(block) -> (root, place in forward order)
    roots: dict[int, RootFlight] = field(default_factory=dict)
    last_block: bool = False  # backward is in a model's first block: nothing left to prefetch
    on_left: Callable[[int | None], None] | None = None  # told when backward leaves a unit (None: all)

    @classmethod
    def of(cls, module: nn.Module, strategy: Any) -> "GradientFlight":
        from lightning_mem import module_tree

        flight = cls()
        for _, model in module_tree.find_hf_models(module):
            key = id(model)
            flight.unit_of.update({id(p): (key, None) for p in model.parameters()})
            for index, block in enumerate(strategy.blocks_to_shard(model)):
                flight.index[id(block)] = (key, index)
                # The reduce-scatter input holds the gradients of what trains (LoRA: the adapters).
                flight.unit_bytes[id(block)] = sum(p.numel() * p.element_size() for p in block.parameters()
                                                   if p.requires_grad)
                flight.unit_of.update({id(p): (key, id(block)) for p in block.parameters()})
                block.register_forward_pre_hook(flight._entered, with_kwargs=True)
        return flight

    def _entered(self, block: nn.Module, args: tuple, kwargs: dict) -> None:
        inputs = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.requires_grad]
        if inputs and torch.is_grad_enabled():
            inputs[0].register_hook(lambda grad, unit=id(block): self._left(unit))

    def _left(self, unit: int) -> None:
        if self.on_left is not None:
            self.on_left(unit)
        key, index = self.index[unit]
        state = self.roots.setdefault(key, RootFlight())
        if unit == state.current:  # its gradients are reduced now; the reduce-scatter input stays
            state.buffered = self.unit_bytes[unit]
            state.current, state.current_bytes = None, 0
        # Backward enters the block before this one, which was prefetched; with no block before
        # that, FSDP2 has nothing more to prefetch: one block stays gathered, not two.
        self.last_block = index == 1

    @property
    def unreduced(self) -> int:
        return sum(state.root + state.current_bytes for state in self.roots.values())

    @property
    def buffered(self) -> int:
        return sum(state.buffered for state in self.roots.values())

    def add(self, param: torch.Tensor) -> None:
        nbytes = param.grad.numel() * param.grad.element_size()
        key, unit = self.unit_of.get(id(param), (0, None))  # 0: a unit of its own (a value head)
        state = self.roots.setdefault(key, RootFlight())
        if unit is None:
            state.root += nbytes
            return
        if self.index[unit][1] > 0:
            self.last_block = False
        if unit != state.current:
            if state.current is not None:  # backward left that block: it reduced
                state.buffered = self.unit_bytes[state.current]
            state.current, state.current_bytes = unit, 0
        state.current_bytes += nbytes

    @property
    def in_backward(self) -> bool:
        return bool(self.roots)

    def reset(self) -> None:
        if self.on_left is not None:
            self.on_left(None)
        self.roots.clear()
        self.last_block = False


class RankView(PhaseRecorder):
    """A recorder whose ledger sees one rank of the strategy's sharding (see the module's docstring).

    ``strategy`` is the config's strategy object (None: a single device); the run calls
    :meth:`follow_ranks` once the fit has its optimizers.
    """

    def __init__(self, ledger: MemoryLedger, *, sharding: Sharding | None = None, world_size: int = 1,
                 strategy: Any = None) -> None:
        super().__init__(ledger, sharding=sharding, world_size=world_size)
        self.strategy = strategy
        self._flight: GradientFlight | None = None
        self._root_bytes: dict[int, int] = {}  # id(model) -> its root unit's parameter bytes
        self._in_forward: set[int] = set()
        self._entering = False
        self._scales: dict[str, float] = {}  # sharded bytes per measured byte (FSDP2 mixed precision)
        self._shard_dtype = torch.float32
        self._resident: dict[int, int] = {}  # units kept gathered after their forward -> bytes

    def follow_ranks(self, pl_module: nn.Module) -> None:
        """Hook the models so that the ledger's peaks are one rank's (a sharded run only)."""
        if not self.sharding.shard:
            return
        from lightning_mem import module_tree

        for _, model in module_tree.find_hf_models(pl_module):
            model.register_forward_pre_hook(self._forward)
        if self.sharding.unit_gradients:  # FSDP2 reduce-scatters gradients unit by unit
            self._flight = GradientFlight.of(pl_module, self.strategy)
            self._follow_units(pl_module)
        self.ledger.view = self._per_rank

    def _split_like_the_run(self, pl_module: nn.Module) -> None:
        """What a model split by tensor or context parallelism computes beyond its share of this
        one-process run: the recipe pads each sequence to a multiple of ``cp`` (times ``tp`` under
        sequence parallelism) before splitting it -- a 41-token GRPO sequence is 2 x 21 tokens, not
        2 x 20.5 -- so this run pads as the run does (a layout of one slice: the padding alone);
        and Ulysses' exchanges allocate copies the division misses (:mod:`.ulysses`)."""
        from lightning_mem import module_tree
        from lightning_mem.context_parallel import SequenceLayout, attach_layout
        from lightning_mem.estimate.ulysses import use_ulysses_footprint

        sharding = self.sharding
        multiple = sharding.context_parallel * (sharding.tensor_parallel if sharding.sequence_parallel else 1)
        for _, model in module_tree.find_hf_models(pl_module):
            if multiple > 1:
                attach_layout(model, SequenceLayout(multiple=multiple))
            if sharding.context_parallel > 1:
                use_ulysses_footprint(model, active=lambda: self._phase != "rollout")

    def _compute_in(self, dtype: torch.dtype, module: nn.Module) -> None:
        """FSDP2's mixed precision: units are gathered, and compute, in ``dtype`` while the shards and
        the optimizer keep the parameters' dtype. The run computes in ``dtype`` (its activations,
        gathered units and unreduced gradients are then the real ones); the per-rank view scales the
        sharded categories back to the shards' dtype (:func:`~lightning_mem.estimate.sharding.shard_per_rank`'s ``scales``)."""
        params = [p for p in module.parameters() if p.is_floating_point()]
        before = sum(p.numel() * p.element_size() for p in params)
        trained = [p for p in params if p.requires_grad]
        shard_size = trained[0].element_size() if trained else 4
        self._shard_dtype = trained[0].dtype if trained else torch.float32
        for t in [*params, *module.buffers()]:
            if t.is_floating_point() and t.dtype != dtype:
                t.data = t.data.to(dtype)
        after = sum(p.numel() * p.element_size() for p in params)
        size = torch.empty((), dtype=dtype).element_size()
        reduce_size = torch.empty((), dtype=self.sharding.reduce_dtype or dtype).element_size()
        self._scales = {"weights": before / max(after, 1), "gradients": shard_size / size,
                        "reduce_scatter": reduce_size / size}

    def _optimizer_state_scale(self) -> float:
        # The state of a parameter computed in param_dtype would be in the shard's dtype (AdamW's
        # moments follow their parameter; 8-bit states do not).
        dtype = self.sharding.param_dtype
        measured = scaled = 0
        for opt in self.optimizers:
            for state in opt.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        nbytes = value.numel() * value.element_size()
                        measured += nbytes
                        scaled += nbytes * (self._shard_dtype.itemsize / value.element_size()
                                            if value.dtype == dtype else 1)
        return scaled / measured if measured else 1.0

    @override
    def _stepped(self, opt: Any) -> None:
        super()._stepped(opt)
        if self.sharding.param_dtype is not None:
            self._scales["optimizer_state"] = self._optimizer_state_scale()

    def _follow_units(self, module: nn.Module) -> None:
        """FSDP2 gathers a model's root unit for its forward and its backward only; and when a forward
        enters a unit, the previous unit's flat all-gather output is still alive beside the new one
        while the new unit's parameters are copied out (:attr:`Sharding.forward_gathered_units`)."""
        from lightning_mem import module_tree

        for _, model in module_tree.find_hf_models(module):
            key = id(model)
            blocks = module_tree.find_blocks(model, module_tree.default_block_classes(model))
            in_blocks = {id(p) for b in blocks for p in b.parameters()}
            self._root_bytes[key] = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in in_blocks)
            model.register_forward_pre_hook(lambda *_, k=key: self._in_forward.add(k))
            model.register_forward_hook(lambda *_, k=key: self._in_forward.discard(k))
            trained = any(p.requires_grad for p in model.parameters())
            keeps = self.sharding.reshard_after_forward is not True and trained  # frozen models reshard
            for block in self.strategy.blocks_to_shard(model):
                block.register_forward_pre_hook(self._entering_unit)
                if keeps and self.sharding.reshard_after_forward is False:  # gathered from now until its backward
                    block.register_forward_pre_hook(lambda *_, b=block, k=key: self._keep(k, b))
                elif keeps:  # an int: resharded to a smaller group after its forward
                    block.register_forward_hook(lambda *_, b=block, k=key: self._keep(k, b))
            if keeps:
                model.register_forward_hook(lambda *_, k=key: self._keep(k, None))
        if self._flight is not None:
            self._flight.on_left = self._release

    def _keep(self, model: int, block: nn.Module | None) -> None:
        """A unit that ``reshard_after_forward`` keeps after its forward (None: the model's root)."""
        if not torch.is_grad_enabled():
            return
        k = self.sharding.reshard_after_forward
        nbytes = self._root_bytes[model] if block is None else sum(
            p.numel() * p.element_size() for p in block.parameters())
        self._resident[id(block) if block is not None else model] = nbytes if k is False else math.ceil(nbytes / k)

    def _release(self, unit: int | None) -> None:
        """Backward left ``unit`` (None: all of them, at its end): FSDP2 reshards it."""
        if unit is None:
            self._resident.clear()
        else:
            self._resident.pop(unit, None)

    def _entering_unit(self, *_: Any) -> None:
        self._entering = True
        try:
            self.ledger.observe()
        finally:
            self._entering = False

    @override
    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        if self._flight is not None:  # FSDP2 reduces the root units and frees its buffers at the end
            self._flight.reset()

    def _per_rank(self, breakdown: dict[str, int], host: int) -> tuple[dict[str, int], int]:
        flight = self._flight
        units, count, resident = self._units, self._gathered_units(), 0
        if flight is not None:  # the roots gathered now: models in a forward, or in a backward
            block, _ = units
            active = self._in_forward | set(flight.roots)
            units = (block, sum(self._root_bytes.get(k, 0) for k in active))
            kept_blocks = sum(v for k, v in self._resident.items() if k not in self._root_bytes)
            kept_roots = sum(v for k, v in self._resident.items() if k in self._root_bytes and k not in active)
            if kept_blocks and self.sharding.reshard_after_forward is False:
                # Every unit it computes with is among those kept; a forward holds the latest flat
                # all-gather output beside them, a backward nothing more.
                count = 0 if flight.in_backward else 1
            resident = kept_blocks + kept_roots
        return shard_per_rank(breakdown, host, self.sharding, self.world_size, units, self._grad_size,
                              scales=self._scales, resident=resident,
                              gathered=not self._stepping,
                              in_flight=(flight.unreduced, flight.buffered) if flight is not None else None,
                              gathered_units=count, generating=self._phase == "rollout")

    def _gathered_units(self) -> int | None:
        flight = self._flight
        if flight is None:
            return None
        if flight.last_block:  # backward in a model's first block: nothing left to prefetch
            return 1
        if self._entering and not flight.in_backward and self.sharding.forward_gathered_units:
            return self.sharding.forward_gathered_units
        return None

    @override
    def _gradient_ready(self, param: torch.Tensor) -> None:
        if self._flight is not None:  # before the retag: the view then sees the unit's progress
            self._flight.add(param)
        super()._gradient_ready(param)

    def _checkpointing(self) -> None:
        # FSDP2Strategy's own activation checkpointing, applied to the blocks it would shard.
        strategy = self.strategy
        if strategy is None or not getattr(strategy, "_checkpoint_every", 0):
            return
        from lightning_mem import activation_checkpointing, module_tree

        for _, model in module_tree.find_hf_models(self.module):
            blocks = strategy.blocks_to_shard(model)
            for index in activation_checkpointing.checkpointed_indices(len(blocks), strategy._checkpoint_every):
                strategy.apply_activation_checkpointing(blocks[index])
