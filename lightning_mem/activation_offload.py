"""Activation offload: keep the tensors autograd saves for backward in host memory.

During a training forward pass, autograd keeps every tensor a backward formula needs (inputs of
matmuls, normalized hidden states, attention outputs...). For long sequences these saved
activations, not the weights, dominate device memory. :class:`ActivationOffloader` installs
``torch.autograd.graph.saved_tensors_hooks`` that copy each saved tensor's storage to host
memory as soon as it is saved, so the device copy can be freed, and copy it back when backward
asks for it.

How it behaves:

- **Unique storages only.** Several saved tensors often share one storage (``x`` and
  ``x.view(...)`` saved by q/k/v projections, a tensor saved twice by ``x * x``). The storage is
  copied once; each saved tensor is rebuilt as a view of the restored storage. A storage that
  was modified in place between two saves (a new version) is copied again.
- **What it skips:** parameters and views of parameters (they stay resident anyway), leaves that
  require grad, buffers of ``module``, tensor subclasses (DTensor, quantized weights), tensors
  on another device type, storages under ``min_bytes``, and everything saved while a module
  named in ``exclude_modules`` runs its forward.
- **CUDA:** host buffers are pinned, device→host copies run on a side stream, at most
  ``max_inflight`` copies keep their source alive at a time, and during backward the next
  ``prefetch`` stashes (in reverse save order, which is backward order) are copied back ahead
  of need.
- **CPU:** host and device are the same memory, so offloading saves nothing; the copies still
  happen (into separate host buffers and back into fresh buffers) so results and mechanics are
  the same as on an accelerator.
- **Checkpointing:** under non-reentrant activation checkpointing, checkpoint's own hooks handle
  the tensors inside each checkpointed block; what reaches these hooks is each block's inputs
  (the tensors checkpoint keeps for recomputation) and whatever runs outside checkpointed
  blocks. The two compose: checkpointing shrinks what is saved, offload moves the rest.

The Lightning callback over it is :class:`lightning_mem.callbacks.ActivationOffload`.
"""

from __future__ import annotations

import fnmatch
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch
from lightning.pytorch.utilities.rank_zero import WarningCache
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from lightning_mem.settings import SettingError

_warning_cache = WarningCache()  # once per process

# Above this many remembered storages, forget the ones whose stash died with its graph.
_DEDUPE_PRUNE_AT = 4096


@dataclass
class ActivationOffloadStats:
    """Counters since the last :meth:`ActivationOffloader.reset_stats`.

    ``stashed_bytes`` is the sum of the sizes of the unique storages copied to host.
    """

    saved_tensors: int = 0  # every tensor autograd saved while the hooks were installed
    stashed_tensors: int = 0  # unique storages copied to host
    stashed_bytes: int = 0
    deduplicated_tensors: int = 0  # saves served by a storage already stashed
    skipped_tensors: int = 0  # parameters, leaves, buffers, small, subclasses, other devices
    excluded_tensors: int = 0  # saved inside an excluded module
    passed_through_tensors: int = 0  # saved while paused (e.g. during backward)
    restored_tensors: int = 0  # host -> device copies
    restored_bytes: int = 0
    prefetched_tensors: int = 0  # restores started before backward asked for them


class _Stash:
    """One storage copied to host, and its device-side buffers while they exist."""

    __slots__ = (
        "__weakref__",
        "consumed",
        "copied",
        "device",
        "host",
        "index",
        "nbytes",
        "order",
        "pending",
        "ready",
        "restored",
        "source",
        "users",
        "version",
    )

    def __init__(self, nbytes: int, version: int, device: torch.device, host: torch.Tensor) -> None:
        self.nbytes = nbytes
        self.version = version
        self.device = device
        self.host = host  # flat uint8 copy of the storage, on the host
        self.source: Optional[torch.Tensor] = None  # the original storage, held until `copied` fires
        self.copied: Optional[torch.cuda.Event] = None
        self.restored: Optional[torch.Tensor] = None  # flat uint8 device buffer after host -> device
        self.ready: Optional[torch.cuda.Event] = None
        self.users = 0  # saved tensors that point at this stash
        self.pending = 0  # unpacks still expected in the current backward
        self.consumed = False  # every user was unpacked once: do not prefetch it again
        self.order: list = []  # the save order this stash belongs to (for prefetch)
        self.index = -1


class _Saved:
    """What autograd keeps instead of a stashed tensor: the stash plus the view to rebuild."""

    __slots__ = ("dtype", "offset", "size", "stash", "stride")

    def __init__(self, stash: _Stash, tensor: torch.Tensor) -> None:
        self.stash = stash
        self.dtype = tensor.dtype
        self.size = tensor.size()
        self.stride = tensor.stride()
        self.offset = tensor.storage_offset()


def _flat_bytes(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


class ActivationOffloader:
    """Saved-tensor hooks that stash activations on the host; usable as a context manager.

    ``with ActivationOffloader(model): loss = model(x).sum()`` stashes what that forward saves;
    ``loss.backward()`` may run inside or outside the ``with`` block. The object can be entered
    again for the next forward; :attr:`stats` accumulates until :meth:`reset_stats`.

    Args:
        module: the model; its parameters and buffers are never stashed and ``exclude_modules``
            are looked up in it. Optional when ``exclude_modules`` is empty.
        device: tensors on this device type are stashed. Defaults to CUDA when available,
            else CPU (where the copies happen but save nothing).
        min_bytes: storages smaller than this stay where they are (copies of tiny tensors cost
            more in latency than they save).
        pin_memory: pin the host buffers; defaults to True on CUDA. Ignored (with a warning) on
            CPU, where pinning needs an accelerator.
        use_streams: on CUDA, run copies on a side stream so they overlap compute.
        max_inflight: on CUDA, the most device->host copies whose source is kept alive at once;
            the oldest is waited for beyond that, which bounds the extra device memory.
        prefetch: during backward, how many stashes ahead of the one being unpacked are copied
            back early. 0 restores each one only when backward needs it.
        exclude_modules: module names (``fnmatch`` patterns, matched against the full name or
            its last components, e.g. ``"lm_head"``, ``"*.mlp"``) whose forward saves nothing to
            host: use it for modules whose backward comes first (the output projection).
    """

    def __init__(
        self,
        module: Optional[nn.Module] = None,
        *,
        device: Optional[torch.device | str] = None,
        min_bytes: int = 1024,
        pin_memory: Optional[bool] = None,
        use_streams: bool = True,
        max_inflight: int = 4,
        prefetch: int = 2,
        exclude_modules: Iterable[str] = (),
    ) -> None:
        for name, value, least in (("min_bytes", min_bytes, 0), ("max_inflight", max_inflight, 1), ("prefetch", prefetch, 0)):
            if value < least:
                raise SettingError(name, f" must be >= {least}, got {value}")
        self.exclude_modules = tuple(exclude_modules)
        if self.exclude_modules and module is None:
            raise ValueError("ActivationOffloader: `exclude_modules` needs the `module` to look the names up in")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.module = module
        self.min_bytes = min_bytes
        self.max_inflight = max_inflight
        self.prefetch = prefetch
        on_cuda = self.device.type == "cuda"
        if pin_memory and not on_cuda:
            # NOTE: pinned memory needs an accelerator; on a CPU-only build pinning raises.
            _warning_cache.warn(f"ActivationOffloader: pin_memory=True does nothing on {self.device.type}; ignored.")
        self.pin_memory = bool(on_cuda if pin_memory is None else pin_memory and on_cuda)
        self._side_stream = torch.cuda.Stream(self.device) if on_cuda and use_streams else None
        self.stats = ActivationOffloadStats()
        self._hooks: Optional[torch.autograd.graph.saved_tensors_hooks] = None
        self._module_hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._excluded_depth = 0
        self._paused = 0
        self._resident_ptrs: set[int] = set()
        self._by_storage: dict[StorageWeakRef, weakref.ref] = {}
        self._order: list[weakref.ref] = []
        self._inflight: deque[_Stash] = deque()

    # -- lifecycle -------------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        return self._hooks is not None

    def __enter__(self) -> "ActivationOffloader":
        if self.active:
            raise RuntimeError("ActivationOffloader is already active; it cannot be entered twice")
        self._resident_ptrs = self._resident_storage_ptrs()
        self._register_exclusions()
        self._by_storage = {}
        self._order = []  # a new save order: stashes from an earlier forward keep theirs
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._hooks is None:
            return
        self._hooks.__exit__(*exc)
        self._hooks = None
        for handle in self._module_hooks:
            handle.remove()
        self._module_hooks.clear()
        self._excluded_depth = 0
        self._paused = 0
        # Saved tensors still in a graph keep their stashes; only the lookup table goes.
        self._by_storage = {}

    def pause(self) -> None:
        """Let saved tensors through untouched until :meth:`resume` (e.g. during backward, where
        a reentrant checkpoint's recomputation would otherwise be copied out and straight back)."""
        self._paused += 1

    def resume(self) -> None:
        self._paused = max(0, self._paused - 1)

    def reset_stats(self) -> None:
        self.stats = ActivationOffloadStats()

    def synchronize(self) -> None:
        """Wait for every device->host copy in flight and release the sources they hold."""
        while self._inflight:
            self._release(self._inflight.popleft(), wait=True)

    # -- pack: forward ---------------------------------------------------------------------------
    def _pack(self, tensor: torch.Tensor) -> Any:
        self.stats.saved_tensors += 1
        if self._paused:
            self.stats.passed_through_tensors += 1
            return tensor
        if self._excluded_depth:
            self.stats.excluded_tensors += 1
            return tensor
        if not self._should_stash(tensor):
            self.stats.skipped_tensors += 1
            return tensor
        storage = tensor.untyped_storage()
        key = StorageWeakRef(storage)
        ref = self._by_storage.get(key)
        stash = ref() if ref is not None else None
        if stash is not None and stash.version == tensor._version:
            self.stats.deduplicated_tensors += 1
        else:
            stash = self._stash(storage, tensor._version, tensor.device)
            self._by_storage[key] = weakref.ref(stash)
            if len(self._by_storage) > _DEDUPE_PRUNE_AT:
                self._by_storage = {k: r for k, r in self._by_storage.items() if r() is not None}
        stash.users += 1
        stash.pending += 1
        return _Saved(stash, tensor)

    def _should_stash(self, tensor: torch.Tensor) -> bool:
        # Exact type: Parameter, DTensor, FakeTensor and quantized-weight subclasses stay put.
        if type(tensor) is not torch.Tensor or tensor.layout is not torch.strided:
            return False
        if tensor.device.type != self.device.type or tensor.is_quantized or tensor.is_conj() or tensor.is_neg():
            return False
        if tensor.is_leaf and tensor.requires_grad:  # a parameter-like input the caller keeps anyway
            return False
        base = tensor._base
        if base is not None and (type(base) is not torch.Tensor or (base.is_leaf and base.requires_grad)):
            return False  # e.g. weight.t() saved by a matmul: a view of a parameter
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensors without a real storage
            return False
        nbytes = storage.nbytes()
        return nbytes > 0 and nbytes >= self.min_bytes and storage.data_ptr() not in self._resident_ptrs

    def _stash(self, storage: torch.UntypedStorage, version: int, device: torch.device) -> _Stash:
        nbytes = storage.nbytes()
        source = _flat_bytes(storage, device)
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin_memory)
        stash = _Stash(nbytes, version, device, host)
        if device.type == "cuda":
            event = torch.cuda.Event()
            if self._side_stream is not None:
                # The kernels that produced the storage run on the compute stream: wait for them.
                self._side_stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(self._side_stream):
                    host.copy_(source, non_blocking=self.pin_memory)
                    event.record()
            else:
                host.copy_(source, non_blocking=self.pin_memory)
                event.record()
            # Hold the source until the copy has read it: dropping it earlier would let the
            # caching allocator hand the block to a new tensor while the copy still reads it.
            stash.source, stash.copied = source, event
            self._inflight.append(stash)
            self._bound_inflight()
        else:
            host.copy_(source)  # synchronous: the original can be freed as soon as we return
        stash.order = self._order
        stash.index = len(self._order)
        self._order.append(weakref.ref(stash))
        self.stats.stashed_tensors += 1
        self.stats.stashed_bytes += nbytes
        return stash

    def _bound_inflight(self) -> None:
        while self._inflight and self._inflight[0].copied.query():
            self._release(self._inflight.popleft(), wait=False)
        while len(self._inflight) > self.max_inflight:
            self._release(self._inflight.popleft(), wait=True)

    @staticmethod
    def _release(stash: _Stash, wait: bool) -> None:
        if wait and stash.copied is not None:
            stash.copied.synchronize()
        stash.source = None
        stash.copied = None

    # -- unpack: backward ------------------------------------------------------------------------
    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Saved):
            return saved  # passed through at pack time
        if self._inflight:
            self._bound_inflight()
        stash = saved.stash
        buffer = self._device_buffer(stash)
        tensor = torch.empty(0, dtype=saved.dtype, device=buffer.device).set_(
            buffer.untyped_storage(), saved.offset, saved.size, saved.stride
        )
        stash.pending -= 1
        if stash.pending <= 0:
            # Every saved tensor of this storage has its copy now; autograd holds what it needs.
            stash.restored, stash.ready, stash.consumed = None, None, True
            stash.pending = stash.users  # a second backward (retain_graph) restores again
        self._prefetch_before(stash)
        return tensor

    def _device_buffer(self, stash: _Stash) -> torch.Tensor:
        if stash.source is not None:
            # The device->host copy has not been released yet, so the original bytes are still
            # on the device and unchanged (a new version would have made a new stash).
            return stash.source
        if stash.restored is None:
            self._restore(stash)
        if stash.ready is not None:
            torch.cuda.current_stream(stash.device).wait_event(stash.ready)
        return stash.restored

    def _restore(self, stash: _Stash) -> None:
        # Allocated on the compute stream, which is where autograd will use and free it.
        buffer = torch.empty(stash.nbytes, dtype=torch.uint8, device=stash.device)
        if self._side_stream is not None:
            self._side_stream.wait_stream(torch.cuda.current_stream(stash.device))
            with torch.cuda.stream(self._side_stream):
                buffer.copy_(stash.host, non_blocking=self.pin_memory)
                stash.ready = torch.cuda.Event()
                stash.ready.record()
            # A prefetched buffer may be dropped unused; the allocator must not reuse it before
            # the side stream's copy into it is done.
            buffer.record_stream(self._side_stream)
        else:
            buffer.copy_(stash.host, non_blocking=self.pin_memory and stash.device.type == "cuda")
        stash.restored = buffer
        self.stats.restored_tensors += 1
        self.stats.restored_bytes += stash.nbytes

    def _prefetch_before(self, stash: _Stash) -> None:
        # Backward visits saved tensors roughly in reverse save order: start copying the next
        # `prefetch` ones back now so they are on the device when asked for.
        ahead, index = 0, stash.index - 1
        while ahead < self.prefetch and index >= 0:
            other = stash.order[index]()
            index -= 1
            if other is None or other.consumed:
                continue
            if other.restored is None and other.source is None:
                self._restore(other)
                self.stats.prefetched_tensors += 1
            ahead += 1

    # -- what never moves ------------------------------------------------------------------------
    def _resident_storage_ptrs(self) -> set[int]:
        if self.module is None:
            return set()
        ptrs = set()
        for tensor in [*self.module.parameters(), *self.module.buffers()]:
            try:
                ptrs.add(tensor.untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError):  # DTensor shards and other subclasses
                continue
        ptrs.discard(0)
        return ptrs

    def _register_exclusions(self) -> None:
        if not self.exclude_modules:
            return
        matched = [m for name, m in self.module.named_modules() if name and self._excluded(name)]
        if not matched:
            raise SettingError("exclude_modules", f": no module of the model matches {list(self.exclude_modules)}")
        for module in matched:
            self._module_hooks.append(module.register_forward_pre_hook(self._enter_excluded))
            self._module_hooks.append(module.register_forward_hook(self._exit_excluded, always_call=True))

    def _excluded(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name, f"*.{p}") for p in self.exclude_modules)

    def _enter_excluded(self, *_: Any) -> None:
        self._excluded_depth += 1

    def _exit_excluded(self, *_: Any) -> None:
        self._excluded_depth = max(0, self._excluded_depth - 1)
