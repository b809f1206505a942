"""The phase recorder: what each tensor of a fit is (weights, gradients, optimizer state, host),
and the peak of each phase of the measured steps, with the library sections whose allocations have
a known category (KV cache, offloaded copies).

:class:`PhaseRecorder` follows a Lightning fit under a :class:`~lightning_mem.estimate.tracker.MemoryLedger`;
the estimate's run (:mod:`.run`) and the real-tensor measurement (:mod:`.measure`) are both one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning.pytorch import Callback
from typing_extensions import override

from lightning_mem.distillation.teacher import held_models
from lightning_mem.estimate.fake import fake_only_stash, swap_or_set_data
from lightning_mem.estimate.sharding import Sharding, shard_per_rank
from lightning_mem.estimate.tracker import HOST, MemoryLedger
from lightning_mem.offload import local_tensor

@dataclass
class PhaseEstimate:
    """One phase on one rank: the device peak, its breakdown and the host bytes."""

    phase: str
    device_peak_bytes: int
    device_breakdown_bytes: dict[str, int]
    host_peak_bytes: int
    shape: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


#: bitsandbytes' state buffers that a paged optimizer makes in CUDA managed memory, and the size from
#: which it does (``Optimizer8bit.get_state_buffer``: smaller tensors get ordinary device buffers).
PAGED_STATE_KEYS = ("state1", "state2")
PAGED_MIN_NUMEL = 100_000


def pages_on_a_gpu(optimizer: Any) -> bool:
    """Whether ``optimizer`` keeps paged state on the GPU tier the estimate is for.

    The estimate runs on a CPU, where :func:`lightning_mem.optim.page_where_supported` runs a paged
    optimizer unpaged (``is_paged`` cleared); the class still says what the config asked for. A GPU
    tier is taken to page (Linux on a data-centre GPU has concurrent managed access); where it does
    not, the run goes unpaged and holds the state on the device, which the estimate then understates
    by the paged bytes its notes give.
    """
    if getattr(optimizer, "is_paged", False):
        return True
    cls = type(optimizer)
    return cls.__module__.startswith("bitsandbytes") and cls.__name__.startswith("Paged")


def is_paged_buffer(param: torch.Tensor, key: str) -> bool:
    return key in PAGED_STATE_KEYS and param.numel() >= PAGED_MIN_NUMEL


@contextlib.contextmanager
def patched(obj: Any, name: str, wrapper: Callable[[Callable], Callable]) -> Iterator[None]:
    original = getattr(obj, name)
    setattr(obj, name, wrapper(original))
    try:
        yield
    finally:
        setattr(obj, name, original)


def in_section(ledger: MemoryLedger, category: str) -> Callable[[Callable], Callable]:
    """Wrap a function so that what it allocates is counted as ``category``."""

    def wrap(fn: Callable) -> Callable:
        def inner(*args: Any, **kwargs: Any) -> Any:
            with ledger.section(category):
                return fn(*args, **kwargs)

        return inner

    return wrap


@contextlib.contextmanager
def attribution(ledger: MemoryLedger, fake: bool) -> Iterator[None]:
    """Sections of library code whose allocations have a known category: the KV cache layers of
    transformers, the host copies of :mod:`lightning_mem.offload` and of activation offload."""
    from transformers import cache_utils

    from lightning_mem import offload
    from lightning_mem import activation_offload

    with contextlib.ExitStack() as stack:
        for cls in (cache_utils.DynamicLayer, cache_utils.StaticLayer):
            for method in ("lazy_initialization", "update"):
                stack.enter_context(patched(cls, method, in_section(ledger, "kv_cache")))
        for fn in ("optimizer_state_to_host", "offload_module"):
            stack.enter_context(patched(offload, fn, in_section(ledger, HOST)))
        # What comes back is what it was (the phase's retag comes before the plan moves it in).
        stack.enter_context(patched(offload, "optimizer_state_to_device", in_section(ledger, "optimizer_state")))
        stack.enter_context(patched(offload, "reload_module", in_section(ledger, "weights")))
        stack.enter_context(patched(activation_offload.ActivationOffloader, "_stash", in_section(ledger, HOST)))
        stack.enter_context(patched(torch.utils, "swap_tensors", swap_or_set_data))
        if fake:
            stack.enter_context(patched(activation_offload.ActivationOffloader, "_should_stash", fake_only_stash(ledger)))
        yield


class MeasuredStep(Exception):
    """Raised by the estimate's callback once its measured step is recorded: the fit stops there,
    as a run stopped by a crash would (no end-of-fit export, no checkpoint)."""


class PhaseRecorder(Callback):
    """Follows a Lightning fit under a :class:`~lightning_mem.estimate.tracker.MemoryLedger`: tells the
    ledger what each tensor is, and records the peak of each phase of the measured steps.

    Parameters are weights, ``p.grad`` gradients, optimizer state tensors optimizer state (each
    unless its storage is on the host). The phases are those a step reports (``rollout``, ``score``,
    ``train``: :func:`lightning_mem.callbacks.memory_phase` reaches this callback as it reaches the
    ``MemoryMonitor``); a step that reports none is one phase, ``train``, from its first micro-batch
    to its optimizer step, and the time a step spends outside the phases it reports is ``train``
    too when it reports no ``train`` of its own (the SFT recipe's ``teacher`` phase: the student's
    forward, backward and optimizer step are around it). Over several measured steps a phase keeps
    its largest peak.
    :meth:`measured` says which optimizer steps count (the estimate: the one after its warm-up; a
    real run: every one after the first). A phase reported outside the training steps (a pass over
    the data before the first one: the DPO recipe's ``precompute``) is recorded wherever it runs.
    """

    def __init__(self, ledger: MemoryLedger, *, sharding: Sharding | None = None, world_size: int = 1) -> None:
        self.ledger = ledger
        self.sharding = sharding or Sharding()
        self.world_size = world_size
        self.peaks: dict[str, PhaseEstimate] = {}
        self.module: Any = None
        self.optimizers: list[Any] = []
        self._units = (0, 0)
        self._grad_size = 4
        self._stepping = False
        self._measuring = False
        self._in_step = False  # between a micro-batch's start and its end
        self._named = False  # the current step reported a phase
        self._depth = 0  # open phases: nested ones (an engine's sleep inside the rollout) are part of theirs
        self._shape = ""
        self._phase: str | None = None  # the phase a step reported, while it runs
        self._names: set[str] = set()  # the phases the current step reported
        self._rest: PhaseEstimate | None = None  # its largest peak outside them
        #: Paged optimizer state (bitsandbytes' managed buffers) per parameter, and the largest one:
        #: the pages the update of one parameter needs on the device (see :func:`pages_on_a_gpu`).
        self.paged_bytes: dict[int, int] = {}
        self.paged_working_set = 0

    @property
    def phases(self) -> list[PhaseEstimate]:
        return list(self.peaks.values())

    def measured(self, step: int) -> bool:
        """Whether optimizer step ``step`` (0-based, counted by this fit's batches) is measured."""
        return step >= 1

    def step_of(self, trainer: Any, batch_idx: int) -> int:
        """The optimizer step (0-based) that micro-batch ``batch_idx`` belongs to: Lightning groups
        ``accumulate_grad_batches`` consecutive ones."""
        return batch_idx // trainer.accumulate_grad_batches

    # -- Lightning hooks --------------------------------------------------------------------------
    @override
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self.module = pl_module
        self.optimizers = list(trainer.strategy.optimizers)
        self._callbacks = list(trainer.callbacks)
        for opt in self.optimizers:
            opt.register_step_post_hook(lambda o, *_: self._stepped(o))
        for p in pl_module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._gradient_ready)
        self._units, self._grad_size = self.unit_bytes(), self.grad_element_size()
        self.retag()

    @override
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.retag()
        self._in_step = True
        accumulate = trainer.accumulate_grad_batches
        if batch_idx % accumulate == 0 and self.measured(self.step_of(trainer, batch_idx)):  # a measured step begins
            self._measuring, self._named = True, False
            self._names, self._rest = set(), None
            self._shape = self.describe(batch)
            self.ledger.reset_peak()

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._in_step = False
        accumulate = trainer.accumulate_grad_batches
        if not self._measuring or (batch_idx + 1) % accumulate:
            return
        if not self._named:  # a step that names no phases is one: train
            self._record("train", self.step_description(accumulate))
        else:  # the time outside its phases is train, unless it named a train phase itself
            self._fold_rest(self.step_description(accumulate))
            if "train" not in self._names and self._rest is not None:
                self._keep_peak(self._rest)
        self._measuring = False

    def step_description(self, accumulate: int) -> str:
        return f"micro-batch {self._shape}, {accumulate} accumulated"

    @override
    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self._stepping = True  # a sharded model is resharded: nothing gathered, nothing in flight
        # What the step allocates (its temporaries) is the optimizer's, and sharded like its state.
        self.ledger.begin_section("optimizer_state")

    # -- phases (a PhaseObserver, like the MemoryMonitor) -----------------------------------------
    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._depth += 1
        outside = not self._in_step  # a pass before (or between) the steps: measured wherever it runs
        top = self._depth == 1 and (self._measuring or outside)
        if top:
            self._fold_rest(f"batch of {self._shape}")
            self._named, self._phase = self._named or not outside, name
            self._names.add(name)
            self.retag()
            self.ledger.reset_peak()
        try:
            yield
        finally:
            self._depth -= 1
            if top:
                self._phase = None
        if top:
            self._record(name, f"batch of {self._shape}" if self._shape else "before the first step")
            self.ledger.reset_peak()  # what follows, outside any phase, is measured on its own

    def _fold_rest(self, shape: str) -> None:
        """Keep the peak since the last phase (or the step's start) as the step's time outside its phases."""
        if not self._measuring:
            return
        new = self._estimate("train", shape)
        if self._rest is None or new.device_peak_bytes > self._rest.device_peak_bytes:
            self._rest = new

    def _record(self, name: str, shape: str) -> None:
        self._keep_peak(self._estimate(name, shape))

    def _keep_peak(self, new: PhaseEstimate) -> None:
        """``new`` is its phase's peak if it is the largest seen (the host peak: the largest either way)."""
        old = self.peaks.get(new.phase)
        if old is None or new.device_peak_bytes > old.device_peak_bytes:
            self.peaks[new.phase] = new
        if old is not None and old.host_peak_bytes > self.peaks[new.phase].host_peak_bytes:
            self.peaks[new.phase].host_peak_bytes = old.host_peak_bytes

    def _estimate(self, name: str, shape: str) -> PhaseEstimate:
        ledger = self.ledger
        if ledger.view is not None:  # the peak of one rank's view, taken at every moment
            breakdown, host = dict(ledger.peak_breakdown), ledger.peak_host_bytes
        else:  # the unsharded peak, divided over the ranks
            breakdown, host = shard_per_rank(ledger.peak_breakdown, ledger.peak_host_bytes, self.sharding,
                                             self.world_size, self._units, self._grad_size,
                                             generating=name == "rollout")
        if name == "train" and self.paged_working_set:
            # The parameter being updated has its paged state on the device (bitsandbytes prefetches
            # it before the update); one parameter's, whole or this rank's shard of it.
            share = self.world_size if "optimizer_state" in self.sharding.shard else 1
            breakdown = {**breakdown, "optimizer_state": breakdown["optimizer_state"] + math.ceil(self.paged_working_set / share)}
        return PhaseEstimate(name, sum(breakdown.values()), breakdown, host, shape)

    @staticmethod
    def describe(batch: Any) -> str:
        if not isinstance(batch, dict):
            return "?"
        rows = rows_of(batch)
        tokens = max((v.shape[1] for v in batch.values() if isinstance(v, torch.Tensor) and v.dim() >= 2), default=0)
        return f"{rows} x {tokens} tokens"

    # -- the ledger's categories ------------------------------------------------------------------
    def _gradient_ready(self, param: torch.Tensor) -> None:
        self.ledger.retag(param.grad, "gradients")

    def _stepped(self, opt: Any) -> None:
        self.ledger.end_section("optimizer_state")
        self._retag_optimizer(opt)

    def _forward(self, *_: Any) -> None:
        self._stepping = False  # a forward gathers again

    def retag(self) -> None:
        """Parameters and buffers are weights, gradients gradients, optimizer tensors state (unless on the host)."""
        if self.module is None:
            return
        ledger = self.ledger
        held = [t for m in held_models(self.module) for t in (*m.parameters(), *m.buffers(), *_quantization_state(m))]
        for t in [*self.module.parameters(), *self.module.buffers(), *_quantization_state(self.module), *held]:
            if ledger.category_of(t) != HOST:
                ledger.retag(t, "weights")
            if isinstance(t, nn.Parameter) and t.grad is not None and ledger.category_of(t.grad) != HOST:
                ledger.retag(t.grad, "gradients")
        for opt in [*self.optimizers, *self._in_backward_optimizers()]:
            self._retag_optimizer(opt)

    def _in_backward_optimizers(self) -> list:
        # OptimizerInBackward steps one optimizer per parameter (built in its on_fit_start, stepped in
        # backward, not by Lightning): their state is optimizer state too.
        from lightning_mem.callbacks.optimizer_in_backward import OptimizerInBackward

        return [opt for cb in getattr(self, "_callbacks", ()) if isinstance(cb, OptimizerInBackward) and cb.stepper
                for opt in cb.stepper.optimizers.values()]

    def _retag_optimizer(self, opt: Any) -> None:
        paged = pages_on_a_gpu(opt)
        for param, state in opt.state.items():
            managed = 0
            for key, value in state.items():
                if not isinstance(value, torch.Tensor) or self.ledger.category_of(value) == HOST:
                    continue
                if paged and is_paged_buffer(param, key):
                    # CUDA managed memory: outside the caching allocator's count, and the driver moves
                    # its pages to the host when the card runs short. Counted on the host (its worst
                    # case); what must be resident is one parameter's pages at its update, below.
                    self.ledger.retag(value, HOST)
                    managed += local_tensor(value).untyped_storage().nbytes()
                else:
                    self.ledger.retag(value, "optimizer_state")
            if paged:
                # The largest count seen: a later pass (each phase's end retags) finds the managed
                # buffers already on the host and would count 0 for them.
                self.paged_bytes[id(param)] = max(self.paged_bytes.get(id(param), 0), managed)
                self.paged_working_set = max(self.paged_working_set, managed)

    def unit_bytes(self) -> tuple[int, int]:
        """(largest decoder block, everything outside the blocks) parameter bytes, over all models."""
        from lightning_mem import module_tree

        block, root = 0, 0
        for _, model in module_tree.find_hf_models(self.module):
            blocks = module_tree.find_blocks(model, module_tree.default_block_classes(model))
            in_blocks = {id(p) for b in blocks for p in b.parameters()}
            sizes = [sum(p.numel() * p.element_size() for p in b.parameters()) for b in blocks]
            block = max([block, *sizes])
            root += sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in in_blocks)
        return block, root

    def grad_element_size(self) -> int:
        trainable = [p for p in self.module.parameters() if p.requires_grad]
        return trainable[0].element_size() if trainable else 4


def rows_of(batch: dict[str, Any]) -> int:
    return next((v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor) and v.dim() >= 1), 0)


def _quantization_state(module: nn.Module) -> list[torch.Tensor]:
    """The tensors a quantized weight holds besides its packed bytes (absmax, code books, ...):
    weights, though neither parameters nor buffers."""
    from lightning_mem.quantization import quant_state_tensors, is_quantized_linear

    return [t for m in module.modules() if is_quantized_linear(m) for t in quant_state_tensors(m.weight)]
