"""The ledger of live tensor bytes: one entry per storage, by category, its device peak and host bytes.

:class:`MemoryLedger` holds one entry per tensor storage (views share it, so they count once):
its bytes and its category. Categories are assigned when a storage is made (the section of code
that is running says ``kv_cache``, ``optimizer_state`` or ``host``; a floating tensor whose last
dimension is a vocabulary size is ``logits``; other floating tensors are ``activations``; integer
and boolean tensors -- token ids, masks, indices -- are ``other``) and re-assigned when the
estimator learns more (parameters become ``weights``, ``p.grad`` becomes ``gradients``). A
``DTensor`` counts as its local shard: the bytes this rank holds. The ledger keeps the running
total of device bytes, its peak, and the breakdown at that peak (or, with a per-rank ``view``,
the peak of what one rank holds). :class:`~lightning_mem.estimate.tracker.TrackingMode` feeds it.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from lightning_mem.offload import local_tensor

CATEGORIES = ("weights", "gradients", "optimizer_state", "activations", "logits", "kv_cache", "other")
HOST = "host"


class MemoryLedger:
    """Live bytes per tensor storage and category; device peak and its breakdown; host bytes."""

    def __init__(self, vocab_sizes: set[int] | None = None) -> None:
        self.vocab_sizes = set(vocab_sizes or ())
        self._live: dict[int, list[Any]] = {}  # id(storage) -> [weakref, nbytes, category]
        self.totals: dict[str, int] = dict.fromkeys((*CATEGORIES, HOST), 0)
        self.device_bytes = 0
        self.peak_bytes = 0
        self.peak_breakdown: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self.peak_host_bytes = 0
        self._context: list[str] = []
        #: Every storage counts as a multiple of this many bytes (a CUDA caching allocator's block
        #: rounding, :data:`lightning_mem.estimate.cuda.ALLOCATOR_ROUND_BYTES`; 1: exact bytes).
        self.round_bytes = 1
        #: One rank's view of the live bytes, when the measured process stands for several ranks
        #: (a sharding strategy measured unsharded): ``view(device breakdown, host bytes)`` gives
        #: the rank's ``(breakdown, host bytes)``. The peaks are then the view's, taken at every
        #: moment -- the rank's peak need not fall where the unsharded process peaks.
        self.view: Callable[[dict[str, int], int], tuple[dict[str, int], int]] | None = None

    # -- sections of code that decide the category of what they allocate ----------------------
    @contextlib.contextmanager
    def section(self, category: str) -> Iterator[None]:
        self._context.append(category)
        try:
            yield
        finally:
            self._context.pop()

    def begin_section(self, category: str) -> None:
        """:meth:`section` opened and closed by two hooks (an optimizer step's pre- and post-hook)."""
        self._context.append(category)

    def end_section(self, category: str) -> None:
        for index in range(len(self._context) - 1, -1, -1):  # the latest one of that category
            if self._context[index] == category:
                del self._context[index]
                return

    def _category_for(self, tensor: torch.Tensor) -> str:
        if self._context:
            return self._context[-1]
        if tensor.is_floating_point():
            if tensor.dim() >= 2 and tensor.shape[-1] in self.vocab_sizes:
                return "logits"
            return "activations"
        return "other"

    # -- adding, re-tagging, removing ----------------------------------------------------------
    def track(self, tensor: torch.Tensor, category: str | None = None) -> None:
        """Count ``tensor``'s storage (once); ``category`` overrides the automatic one."""
        if type(tensor) is not FakeTensor:  # a fake tensor is never a DTensor
            tensor = local_tensor(tensor)
        if tensor.device.type == "meta":  # no memory anywhere (a module's placeholder before loading)
            return
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        key = id(storage)
        entry = self._live.get(key)
        if entry is not None and entry[0]() is storage:
            if category is not None and entry[2] != category:
                self._move(entry, category)
            nbytes = self._rounded(storage.nbytes())
            if nbytes != entry[1]:  # resized in place
                self._add(entry[2], nbytes - entry[1])
                entry[1] = nbytes
            return
        nbytes = self._rounded(storage.nbytes())
        cat = category or self._category_for(tensor)
        ref = weakref.ref(storage, lambda _r, k=key: self._forget(k, _r))
        self._live[key] = [ref, nbytes, cat]
        self._add(cat, nbytes)

    def _rounded(self, nbytes: int) -> int:
        step = self.round_bytes
        return nbytes if step <= 1 else -(-nbytes // step) * step

    def retag(self, tensor: torch.Tensor | None, category: str) -> None:
        if tensor is not None:
            self.track(tensor, category)

    def category_of(self, tensor: torch.Tensor) -> str | None:
        entry = self._live.get(id(local_tensor(tensor).untyped_storage()))
        return entry[2] if entry is not None else None

    def _forget(self, key: int, ref: weakref.ref) -> None:
        entry = self._live.get(key)
        if entry is not None and entry[0] is ref:
            del self._live[key]
            self._add(entry[2], -entry[1])

    def _move(self, entry: list[Any], category: str) -> None:
        self._add(entry[2], -entry[1], peak=False)
        entry[2] = category
        self._add(category, entry[1])

    def _add(self, category: str, nbytes: int, peak: bool = True) -> None:
        self.totals[category] += nbytes
        if self.view is not None:
            if category != HOST:
                self.device_bytes += nbytes
            if peak and nbytes > 0:  # a rank's view only grows with the bytes: a free sets no peak
                self._observe_view()
            return
        if category == HOST:
            self.peak_host_bytes = max(self.peak_host_bytes, self.totals[HOST])
            return
        self.device_bytes += nbytes
        if peak and self.device_bytes > self.peak_bytes:
            self.peak_bytes = self.device_bytes
            self.peak_breakdown = {c: self.totals[c] for c in CATEGORIES}

    @contextlib.contextmanager
    def unmeasured(self) -> Iterator[None]:
        """Allocations inside do not move the peak; what they leave alive counts from then on.

        For state the estimator sets up in one go that the real run builds gradually (a KV cache
        grown token by token): the real run's transients while building it are smaller than those
        of the step measured next, so only the result belongs to the peak.
        """
        saved = self.peak_bytes, dict(self.peak_breakdown), self.peak_host_bytes
        try:
            yield
        finally:
            self.peak_bytes, self.peak_breakdown, self.peak_host_bytes = saved

    def _observe_view(self) -> None:
        assert self.view is not None
        breakdown, host = self.view({c: self.totals[c] for c in CATEGORIES}, self.totals[HOST])
        self.peak_host_bytes = max(self.peak_host_bytes, host)
        total = sum(breakdown.values())
        if total > self.peak_bytes:
            self.peak_bytes = total
            self.peak_breakdown = breakdown

    def observe(self) -> None:
        """Take the view's peak now, with nothing allocated (the view changed: a unit was gathered)."""
        if self.view is not None:
            self._observe_view()

    def reset_peak(self) -> None:
        if self.view is not None:
            self.peak_bytes, self.peak_host_bytes = -1, 0
            self._observe_view()
            return
        self.peak_bytes = self.device_bytes
        self.peak_breakdown = {c: self.totals[c] for c in CATEGORIES}
        self.peak_host_bytes = self.totals[HOST]
