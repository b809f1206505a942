"""Move optimizer state and frozen modules between the device and host memory.

Two primitives, each with a ledger that says where things live now. On an accelerator the
ledger agrees with ``tensor.device``; on a CPU-only machine host and device are the same memory,
so placement cannot show anything and the ledger is what a test or a recipe inspects. The moves
still happen there (into fresh host buffers and back into fresh buffers), so the mechanics are
the ones that run on a GPU.

Optimizer state (``offload_optimizer_state``, ``optimizer_state_to_host``/``_to_device``):

- torch optimizers: every state tensor that lives with its parameter moves; scalar ``step``
  tensors that torch keeps on the CPU next to CUDA parameters are already on the host and stay.
  Each tensor returns to the device it came from.
- bitsandbytes 8-bit optimizers: ``state1``, ``state2``, ``absmax1/2`` move; the ``qmap``
  tables are shared by every parameter and by ``optimizer.name2qmap``, so they move once and
  every reference follows.
- bitsandbytes paged optimizers: paged buffers are CUDA managed memory; they are not copied but
  their pages are prefetched to the host and back, in place, through
  :func:`lightning_mem.paging.prefetch_paged` (never bitsandbytes' ``prefetch_tensor(...,
  to_cpu=True)``, which ends the process). Where the GPU cannot page (no concurrent managed
  access), or where the runtime refuses the prefetch, nothing moves: the buffer stays where the
  driver keeps it, the ledger does not count it as moved, and a warning says why, once. The recipes never get there: they run a paged
  optimizer unpaged on such a GPU (:func:`lightning_mem.optim.page_where_supported`).
- FSDP2: ``DTensor`` state moves its local shard; the sharding spec is kept.

Modules (``offload_module``/``reload_module``/``module_offloaded``): parameters and buffers of a
frozen model (reference, reward, critic in PPO) move in place (``param.data`` is swapped, so the
``nn.Parameter`` objects, hooks and optimizers that hold them stay valid).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator, Literal, Optional

import torch
from lightning.pytorch.utilities.rank_zero import WarningCache
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_mem.paging import no_paging_reason, paged_device

_warning_cache = WarningCache()

Location = Literal["device", "host"]


# ---------------------------------------------------------------------------------------------
# Tensors: host copies, DTensor shards, paged buffers
# ---------------------------------------------------------------------------------------------
def is_dtensor(tensor: torch.Tensor) -> bool:
    # DTensor imported once (Lightning imports torch.distributed.tensor anyway): an import statement
    # here ran on every tensor the estimate's ledger counts (400k calls in a 70B estimate).
    return isinstance(tensor, DTensor)


def splits(placement: Any) -> bool:
    """Whether a DTensor placement splits a dimension over its mesh dimension: ``Shard`` and also
    ``_StridedShard`` -- FSDP2's placement of a dimension that tensor parallelism split first, whose
    ``is_shard()`` is False in torch 2.13 (it is no longer a ``Shard`` subclass)."""
    return not (placement.is_replicate() or placement.is_partial())


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if is_dtensor(tensor) else tensor


def _with_local(like: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    if not is_dtensor(like):
        return local
    from torch.distributed.tensor import DTensor

    # NOTE: DTensor.from_local() would move a host shard back to the mesh's device; the
    # constructor keeps it where it is (FSDP2's own CPU offload builds its DTensors this way).
    return DTensor(local, like._spec, requires_grad=False)


def _is_paged(tensor: torch.Tensor) -> bool:
    return bool(getattr(tensor, "is_paged", False))


def _nbytes(tensor: torch.Tensor) -> int:
    local = local_tensor(tensor)
    return local.numel() * local.element_size()


def _pin_default(pin_memory: Optional[bool], source: torch.device) -> bool:
    # NOTE: pinned memory needs an accelerator; on a CPU-only build pinning raises.
    if source.type != "cuda":
        return False
    return True if pin_memory is None else pin_memory


def _copy_to(tensor: torch.Tensor, device: torch.device, pin_memory: bool, non_blocking: bool) -> torch.Tensor:
    """A copy of ``tensor`` (or of its local shard) in fresh memory on ``device``, same strides."""
    local = local_tensor(tensor)
    pin = pin_memory and device.type == "cpu"
    out = torch.empty_like(local, device=device, pin_memory=pin)
    # Non-blocking only where it is safe without a wait: into pinned memory or onto a device.
    out.copy_(local, non_blocking=non_blocking and (pin or device.type != "cpu"))
    return _with_local(tensor, out)


def _synchronize(devices: set[torch.device]) -> None:
    for device in devices:
        if device.type == "cuda" and torch.cuda.is_available():
            torch.cuda.synchronize(device)


def _prefetch_paged(tensor: torch.Tensor, to_cpu: bool, owner: str) -> bool:
    """Whether the pages of a paged buffer were sent on their way (see :mod:`lightning_mem.paging`);
    if not, a warning (once) says why."""
    from lightning_mem import paging

    # NOTE: not bitsandbytes.functional.prefetch_tensor: towards the host it asks the CUDA runtime
    # about device -1 and its C library calls exit(1) on the error.
    try:
        if paging.prefetch_paged(tensor, to_host=to_cpu):
            return True
        why = no_paging_reason(paged_device(tensor))
    except RuntimeError as error:
        # A prefetch only advises the driver: the pages stay valid where they are, and the GPU
        # faults them in when it reads them, so training goes on without this one.
        why = str(error)
    _warning_cache.warn(f"offload_optimizer_state: {owner}'s paged state stays where the driver keeps it: {why}")
    return False


# ---------------------------------------------------------------------------------------------
# Optimizer state
# ---------------------------------------------------------------------------------------------
@dataclass
class MovedTensor:
    """One optimizer-state tensor that was moved (shared tensors appear once, with every slot)."""

    slots: tuple[str, ...]  # e.g. ("state[3].exp_avg",) or ("state[0].qmap1", ..., "name2qmap.dynamic")
    nbytes: int  # bytes of the tensor (of the local shard for a DTensor)
    device: torch.device  # where it lives when on the device, and returns to
    paged: bool  # a bitsandbytes paged buffer, its pages prefetched in place instead of copied
    host: Optional[torch.Tensor] = field(default=None, repr=False)  # the host copy while offloaded


@dataclass
class OptimizerStateResidency:
    """Where an optimizer's state lives, and what the last offload moved."""

    location: Location = "device"
    # What the current offload moved (kept after the state comes back, for inspection).
    moved: list[MovedTensor] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return sum(t.nbytes for t in self.moved)

    @property
    def slots(self) -> list[str]:
        return [slot for t in self.moved for slot in t.slots]


_OPTIMIZER_RESIDENCY: "weakref.WeakKeyDictionary[torch.optim.Optimizer, OptimizerStateResidency]" = (
    weakref.WeakKeyDictionary()
)


def optimizer_state_residency(optimizer: torch.optim.Optimizer) -> OptimizerStateResidency:
    """The ledger for ``optimizer`` (location ``"device"`` and nothing moved if never offloaded)."""
    return _OPTIMIZER_RESIDENCY.setdefault(optimizer, OptimizerStateResidency())


def optimizer_state_location(optimizer: torch.optim.Optimizer) -> Location:
    return optimizer_state_residency(optimizer).location


def optimizer_state_slots(optimizer: torch.optim.Optimizer) -> Iterator[tuple[dict, Any, str, Optional[torch.Tensor]]]:
    """(container, key, name, owning parameter) for every tensor the optimizer keeps."""
    index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                yield state, key, f"state[{index.get(id(param), '?')}].{key}", param
    # bitsandbytes keeps its quantization maps here too, shared with every state's qmap1/qmap2.
    name2qmap = getattr(optimizer, "name2qmap", None)
    if isinstance(name2qmap, dict):
        for key, value in name2qmap.items():
            if isinstance(value, torch.Tensor):
                yield name2qmap, key, f"name2qmap.{key}", None


def _training_device(optimizer: torch.optim.Optimizer) -> Optional[torch.device]:
    for group in optimizer.param_groups:
        for param in group["params"]:
            return local_tensor(param).device
    return None


def _lives_on_device(tensor: torch.Tensor, train_device: torch.device) -> bool:
    if _is_paged(tensor):
        return True  # a CPU tensor to torch, but unified memory the kernels use on the GPU
    device = local_tensor(tensor).device
    if train_device.type == "cpu":
        return True  # host and device are one memory: everything is "device" state
    # e.g. torch keeps AdamW's scalar `step` on the CPU next to CUDA params: already on the host.
    return device.type != "cpu"


def optimizer_state_to_host(
    optimizer: torch.optim.Optimizer, pin_memory: Optional[bool] = None, non_blocking: bool = True
) -> OptimizerStateResidency:
    """Move every device-resident state tensor of ``optimizer`` to host memory.

    Tensors already moved (still the host copy in the state) are left alone, so this can run
    after every step while new state appears. Synchronizes before returning, so the host copies
    are complete and the device memory is free to reuse.
    """
    ledger = optimizer_state_residency(optimizer)
    train_device = _training_device(optimizer)
    if train_device is None:
        ledger.location = "host"
        return ledger
    if ledger.location == "device":
        ledger.moved = []  # a new offload; while on the host, later calls add what is new
    already_host = {id(t.host) for t in ledger.moved if t.host is not None}
    groups: dict[int, list[tuple[dict, Any, str]]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for container, key, name, _ in optimizer_state_slots(optimizer):
        tensor = container[key]
        if id(tensor) in already_host:
            continue
        if id(tensor) not in groups:
            if not _lives_on_device(tensor, train_device):
                continue
            tensors[id(tensor)] = tensor
        groups.setdefault(id(tensor), []).append((container, key, name))
    devices = set()
    for tid, slots in groups.items():
        tensor = tensors[tid]
        device = local_tensor(tensor).device
        paged = _is_paged(tensor)
        if paged:
            if not _prefetch_paged(tensor, to_cpu=True, owner=type(optimizer).__name__):
                continue  # not moved: the ledger does not count it
            host, device = tensor, paged_device(tensor)
        else:
            host = _copy_to(tensor, torch.device("cpu"), _pin_default(pin_memory, device), non_blocking)
        for container, key, _ in slots:
            container[key] = host
        devices.add(device)
        ledger.moved.append(MovedTensor(tuple(s[2] for s in slots), _nbytes(tensor), device, paged, host))
    _synchronize(devices)
    ledger.location = "host"
    return ledger


def optimizer_state_onto(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Put every state tensor of ``optimizer`` on ``device`` (e.g. state a checkpoint loaded on the
    CPU), except the scalar ``step`` counters: torch's optimizers keep those on the CPU unless
    ``capturable``, and step them there."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                state[key] = value.to(device)


def optimizer_state_to_device(optimizer: torch.optim.Optimizer, non_blocking: bool = True) -> OptimizerStateResidency:
    """Move what :func:`optimizer_state_to_host` moved back to where each tensor came from."""
    ledger = optimizer_state_residency(optimizer)
    by_host: dict[int, MovedTensor] = {id(t.host): t for t in ledger.moved if t.host is not None}
    restored: dict[int, torch.Tensor] = {}
    devices = set()
    for container, key, _, _ in list(optimizer_state_slots(optimizer)):
        host = container[key]
        moved = by_host.get(id(host))
        if moved is None:
            continue  # never moved, or replaced since (e.g. load_state_dict)
        if id(host) not in restored:
            if moved.paged:
                _prefetch_paged(host, to_cpu=False, owner=type(optimizer).__name__)  # else faulted back on use
                restored[id(host)] = host
            else:
                restored[id(host)] = _copy_to(host, moved.device, False, non_blocking)
            devices.add(moved.device)
        container[key] = restored[id(host)]
    for moved in ledger.moved:
        moved.host = None
    # NOTE: paged prefetches are asynchronous; copies onto a device are ordered on its stream,
    # but the host copies are freed now, so wait for all of them.
    _synchronize(devices)
    ledger.location = "device"
    return ledger


@contextlib.contextmanager
def offload_optimizer_state(
    optimizer: torch.optim.Optimizer, pin_memory: Optional[bool] = None, non_blocking: bool = True
) -> Iterator[OptimizerStateResidency]:
    """Keep ``optimizer``'s state in host memory inside the ``with`` block.

    ``pin_memory`` defaults to pinning when the state is on CUDA (faster, asynchronous copies).
    The round trip is bit-exact. Yields the ledger: ``ledger.moved`` lists what moved,
    ``ledger.bytes`` how much, ``ledger.location`` where the state is now.

    Example (PPO, around the rollout)::

        with offload_optimizer_state(actor_optimizer):
            rollouts = generate(...)
    """
    if optimizer_state_location(optimizer) == "host":
        raise RuntimeError("offload_optimizer_state: the optimizer state is already on the host")
    ledger = optimizer_state_to_host(optimizer, pin_memory=pin_memory, non_blocking=non_blocking)
    try:
        yield ledger
    finally:
        optimizer_state_to_device(optimizer, non_blocking=non_blocking)


# ---------------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------------
@dataclass
class ModuleResidency:
    """Where a module's parameters and buffers live, and what the last move moved."""

    location: Location = "device"
    bytes: int = 0  # parameter + buffer (+ quantization state) bytes moved by the last move
    tensors: int = 0
    home: dict[str, torch.device] = field(default_factory=dict)  # name -> device to return to


_MODULE_RESIDENCY: "weakref.WeakKeyDictionary[nn.Module, ModuleResidency]" = weakref.WeakKeyDictionary()


def module_residency(module: nn.Module) -> ModuleResidency:
    return _MODULE_RESIDENCY.setdefault(module, ModuleResidency())


def module_location(module: nn.Module) -> Location:
    return module_residency(module).location


def _module_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor, bool]]:
    for name, param in module.named_parameters(remove_duplicate=True):
        yield name, param, True
    for name, buffer in module.named_buffers(remove_duplicate=True):
        if buffer is not None:
            yield name, buffer, False


def _move_quant_state(param: torch.Tensor, device: torch.device) -> int:
    """bitsandbytes 4-bit weights carry their absmax/code tables next to the packed data."""
    quant_state = getattr(param, "quant_state", None)
    if quant_state is None or not hasattr(quant_state, "to"):
        return 0
    nbytes = sum(_nbytes(t) for t in (quant_state.absmax, quant_state.code) if isinstance(t, torch.Tensor))
    quant_state.to(device)
    return nbytes


def move_module(
    module: nn.Module,
    device: torch.device | str | dict[str, torch.device],
    pin_memory: Optional[bool] = None,
    non_blocking: bool = True,
) -> tuple[int, int]:
    """Copy every parameter and buffer of ``module`` into fresh memory on ``device``, in place.

    ``device`` is one device or a ``{name: device}`` map (as recorded by :func:`offload_module`).
    ``param.data`` is swapped, so the ``nn.Parameter`` objects stay the same; gradients move with
    their parameters. Host copies are pinned when they come from CUDA (``pin_memory`` default).
    Returns (bytes moved, tensors moved). Synchronizes before returning.

    Raises:
        ValueError: for FSDP2-sharded (DTensor) modules, whose shards FSDP2 owns; use its
            ``CPUOffloadPolicy`` instead.
    """
    if any(is_dtensor(t) for _, t, _ in _module_tensors(module)):
        raise ValueError(
            "move_module: the module holds DTensor (FSDP2-sharded) parameters; FSDP2 owns their "
            "storage, so offload them with the strategy's CPUOffloadPolicy instead"
        )
    total, count, devices = 0, 0, set()
    for name, tensor, is_param in _module_tensors(module):
        target = torch.device(device[name] if isinstance(device, dict) else device)
        source = tensor.device
        pin = _pin_default(pin_memory, source)
        tensor.data = _copy_to(tensor.data, target, pin, non_blocking)
        if is_param and tensor.grad is not None:
            tensor.grad = _copy_to(tensor.grad, target, pin, non_blocking)
        total += _nbytes(tensor) + (_move_quant_state(tensor, target) if is_param else 0)
        count += 1
        devices.update({source, target})
    _synchronize(devices)
    return total, count


def offload_module(module: nn.Module, pin_memory: Optional[bool] = None, non_blocking: bool = True) -> ModuleResidency:
    """Move ``module`` to host memory, remembering where each tensor lived."""
    ledger = module_residency(module)
    if ledger.location == "host":
        return ledger
    ledger.home = {name: t.device for name, t, _ in _module_tensors(module)}
    ledger.bytes, ledger.tensors = move_module(module, torch.device("cpu"), pin_memory, non_blocking)
    ledger.location = "host"
    return ledger


def reload_module(module: nn.Module, non_blocking: bool = True) -> ModuleResidency:
    """Move ``module`` back to where :func:`offload_module` found each tensor."""
    ledger = module_residency(module)
    if ledger.location == "device":
        return ledger
    ledger.bytes, ledger.tensors = move_module(module, ledger.home, False, non_blocking)
    ledger.location = "device"
    return ledger


@contextlib.contextmanager
def module_offloaded(module: nn.Module, pin_memory: Optional[bool] = None) -> Iterator[ModuleResidency]:
    """Keep ``module`` on the host inside the ``with`` block (e.g. the reference model while the
    actor trains), and bring it back on exit."""
    ledger = offload_module(module, pin_memory=pin_memory)
    try:
        yield ledger
    finally:
        reload_module(module)
