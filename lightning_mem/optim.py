"""Optimizer helpers: parameter groups, state accounting, paged-optimizer checks, step-in-backward,
bitsandbytes optimizers on sharded parameters.

Recipes take ``optimizer: OptimizerCallable``, so ``torch.optim.AdamW``,
``bitsandbytes.optim.AdamW8bit``, ``bitsandbytes.optim.PagedAdamW8bit`` and
``bitsandbytes.optim.PagedAdamW32bit`` are a YAML swap; the helpers here are what a recipe calls
around that callable. Under FSDP2 the strategy passes bitsandbytes optimizers through
:func:`step_local_shards` (see :class:`LocalShardStep`).
"""

from __future__ import annotations

import functools
import inspect
import math
import sys
from itertools import chain
from typing import Any, Optional

import torch
from lightning.pytorch.utilities.rank_zero import WarningCache
from torch import nn

from lightning_mem.offload import is_dtensor, local_tensor, optimizer_state_slots, splits
from lightning_mem.paging import PagingQuery, no_paging_reason, paging_supported

_warning_cache = WarningCache()

# Parameters whose name ends with one of these, or that are 1-D (norm weights, biases), get no
# weight decay: decaying a norm's gain or a bias towards zero only hurts.
_NO_DECAY_SUFFIXES = ("bias",)


def param_groups(module: nn.Module, weight_decay: Optional[float]) -> list[dict]:
    """Two groups of trainable parameters: decayed (matrices) and not decayed (norms, biases).

    Frozen parameters are left out, so the optimizer allocates no state for them. With
    ``weight_decay=None`` the decayed group carries no ``weight_decay`` key and the optimizer's
    own setting (from its YAML ``init_args``) applies; the other group always gets 0.
    """
    decay, no_decay = [], []
    for name, param in module.named_parameters():
        if not param.requires_grad:
            continue
        if param.ndim < 2 or name.endswith(_NO_DECAY_SUFFIXES) or "norm" in name.lower():
            no_decay.append(param)
        else:
            decay.append(param)
    if not decay and not no_decay:
        raise ValueError("param_groups: the model has no trainable parameters")
    groups = []
    if decay:
        groups.append({"params": decay} if weight_decay is None else {"params": decay, "weight_decay": weight_decay})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's state tensors, each storage counted once (this rank's shards).

    Shared tensors (bitsandbytes' quantization maps) count once; for FSDP2 ``DTensor`` state
    only the local shard counts. Python numbers (bitsandbytes' ``step``) are not tensors.
    """
    return sum(optimizer_state_bytes_by_dtype(optimizer).values())


def optimizer_state_bytes_by_dtype(optimizer: torch.optim.Optimizer, *, scalars: bool = True) -> dict[torch.dtype, int]:
    """:func:`optimizer_state_bytes` per dtype: AdamW's moments in their parameter's dtype; an 8-bit
    optimizer's uint8 codes beside fp32 scales (and fp32 moments for tensors too small to quantize).
    ``scalars=False`` leaves out 0-dim tensors (AdamW's fp32 step counters)."""
    seen: dict[int, tuple[torch.dtype, int]] = {}
    for container, key, _, _ in optimizer_state_slots(optimizer):
        tensor = local_tensor(container[key])
        if not scalars and tensor.dim() == 0:
            continue
        storage = tensor.untyped_storage()
        seen[storage.data_ptr() or id(storage)] = (tensor.dtype, storage.nbytes())
    totals: dict[torch.dtype, int] = {}
    for dtype, nbytes in seen.values():
        totals[dtype] = totals.get(dtype, 0) + nbytes
    return totals


def page_where_supported(
    optimizer: torch.optim.Optimizer, key: str = "model.optimizer", query: Optional[PagingQuery] = None
) -> bool:
    """Decide, before the first step, whether a paged bitsandbytes optimizer pages its state.

    Where its parameters' device can page (:func:`lightning_mem.paging.paging_supported`, asked
    through ``query`` or the module's hook) the optimizer stays as configured. Elsewhere it becomes
    the non-paged optimizer (``PagedAdamW8bit`` runs as ``AdamW8bit``, every setting kept) and one
    warning names ``key`` and the reason. bitsandbytes' paged and non-paged classes are one
    implementation switched by the constructor flag ``is_paged``, read each time a state buffer is
    made, so clearing it before any state exists gives exactly the non-paged optimizer. Returns
    whether the optimizer pages; not paged to begin with, it is left alone.

    Raises:
        ValueError: the optimizer already holds paged state (decide before its first step).
    """
    if not getattr(optimizer, "is_paged", False):
        return False
    devices = {local_tensor(p).device for g in optimizer.param_groups for p in g["params"]}
    refused = sorted((d for d in devices if not paging_supported(d, query)), key=str)
    if not refused:
        return True
    if any(getattr(t, "is_paged", False) for s in optimizer.state.values() for t in s.values()):
        raise ValueError(
            f"{key}: {type(optimizer).__name__} already holds paged state on a device that cannot page; "
            "page_where_supported must run before the optimizer's first step"
        )
    optimizer.is_paged = False
    name = type(optimizer).__name__
    _warning_cache.warn(
        f"{key}: {name} runs without paging (as {name.removeprefix('Paged') or 'its non-paged twin'}, same "
        f"settings): {no_paging_reason(refused[0])}."
    )
    return False


# ---------------------------------------------------------------------------------------------
# Optimizer step in backward
# ---------------------------------------------------------------------------------------------
def _group_hyperparameters(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}


# Constructor arguments of bitsandbytes' optimizers that their step never reads: validated (Adam8bit
# and AdamW8bit refuse amsgrad=True) and dropped, so the constructor's default rebuilds the same
# optimizer.
_BNB_UNREAD = ("amsgrad",)


def _rebuild_arguments(optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Constructor keyword arguments and attributes that rebuild ``optimizer``'s class, every setting kept.

    torch's optimizers keep every constructor argument in ``defaults``. bitsandbytes' keep the
    per-group ones there and the rest in ``optimizer.args`` (optim_bits, min_8bit_size, max_unorm,
    skip_zeros: the object their constructors document as ``args`` and use instead of those
    arguments when given) and ``optimizer.is_paged`` (an attribute, read whenever a state buffer is
    made: set before the first step it is the constructor's flag, and it carries the paging decision
    of :func:`page_where_supported`).

    Raises:
        ValueError: a constructor argument is kept nowhere, so rebuilding would lose it.
    """
    cls = type(optimizer)
    signature = inspect.signature(cls).parameters
    kwargs = {k: v for k, v in optimizer.defaults.items() if k in signature}
    attributes: dict[str, Any] = {}
    carried = set(kwargs)
    if is_bitsandbytes_optimizer(optimizer):
        settings = vars(optimizer.args)
        if "args" in signature:
            kwargs["args"] = optimizer.args
            carried |= {"args", *settings}
        else:  # e.g. AdEMAMix: the settings are plain arguments
            kwargs.update({k: v for k, v in settings.items() if k in signature})
            carried |= set(settings)
        attributes["is_paged"] = optimizer.is_paged
        # One set of quantization maps for all, as in the one optimizer (not 2 KiB per parameter).
        attributes["name2qmap"] = optimizer.name2qmap
        carried |= {"is_paged", *_BNB_UNREAD}
    missing = [n for n, p in signature.items() if n != "params" and p.kind is not p.VAR_KEYWORD and n not in carried]
    if missing:
        raise ValueError(
            f"StepInBackward rebuilds {cls.__name__} per parameter from `optimizer.defaults` (and bitsandbytes'"
            f" `optimizer.args`), which lack {missing}: those settings would be lost. Use torch.optim.AdamW or"
            " bitsandbytes' AdamW8bit, PagedAdamW8bit or PagedAdamW."
        )
    return kwargs, attributes


def _refuse_bnb_overrides(optimizer: torch.optim.Optimizer) -> None:
    # bitsandbytes' per-parameter overrides (GlobalOptimManager) are also looked up by the position
    # (group, index) in the optimizer, which differs in a one-parameter optimizer.
    manager = getattr(optimizer, "mng", None)
    if manager is None:
        return
    params = {id(p) for g in optimizer.param_groups for p in g["params"]}
    overridden = params & (set(manager.pid2config) | {id(getattr(m, a)) for m, a, _ in manager.module_weight_config_triple})
    if overridden:
        raise ValueError(
            "StepInBackward: bitsandbytes' GlobalOptimManager overrides settings of some parameters; they are"
            " keyed by the parameter's position in the optimizer, which the per-parameter optimizers change."
            " Drop the overrides or step after backward (remove OptimizerInBackward)."
        )


class StepInBackward:
    """Step each parameter as soon as its gradient is complete, then free that gradient.

    One optimizer of the same class per parameter is built from ``optimizer`` (every constructor
    setting, see below, and the hyperparameters of the parameter's group) and stepped from the
    parameter's post-accumulate-grad hook. At most one parameter's gradient is alive at a time,
    instead of all of them between backward and ``optimizer.step()``. ``optimizer`` itself keeps no
    state: its parameters never have a gradient when it steps, so stepping it does nothing. Learning
    rate changes on ``optimizer`` (schedulers) are copied to the per-parameter optimizers before
    every step.

    Every optimizer whose state is per parameter gives the same weights this way as stepping after
    backward: torch's (Adam, AdamW, ...; the settings are in ``optimizer.defaults``) and
    bitsandbytes' (AdamW8bit, PagedAdamW8bit, PagedAdamW, ...; the 8-bit settings are in
    ``optimizer.args``, passed to the constructor as its ``args``, and paging in
    ``optimizer.is_paged``, copied, so a paged optimizer that :func:`page_where_supported` made run
    unpaged stays unpaged). bitsandbytes' state is one set of tensors per parameter either way (a
    parameter under ``min_8bit_size`` elements gets 32-bit state in both).

    Limits, by construction: no gradient accumulation (each backward steps), no clipping by the
    global gradient norm (no moment where all gradients exist; bitsandbytes' ``max_unorm`` clips
    each parameter's update by its own norm and is kept), a single device (no reduction of
    gradients across ranks before the step; FSDP2's sharded DTensor parameters are refused).

    Args:
        module: the model whose parameters ``optimizer`` holds (names key the state dict).
        optimizer: the optimizer as configured, before its first step.

    Raises:
        ValueError: a constructor setting of ``optimizer`` cannot be recovered, a parameter is
            sharded (DTensor) or not in ``module``, or bitsandbytes overrides a parameter's settings.
    """

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        cls = type(optimizer)
        kwargs, attributes = _rebuild_arguments(optimizer)
        _refuse_bnb_overrides(optimizer)
        names = {id(p): n for n, p in module.named_parameters()}
        self._template = optimizer
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self._handles: list[Any] = []
        for group in optimizer.param_groups:
            for param in group["params"]:
                if not param.requires_grad:
                    continue
                if is_dtensor(param):
                    raise ValueError(
                        "StepInBackward runs on a single device: sharded (DTensor) parameters need their "
                        "gradients reduced across ranks before a step"
                    )
                if id(param) not in names:
                    raise ValueError("StepInBackward: the optimizer holds a parameter that is not in the module")
                per_param = cls([{"params": [param], **_group_hyperparameters(group)}], **kwargs)
                for attribute, value in attributes.items():  # before any state exists
                    setattr(per_param, attribute, value)
                self.optimizers[names[id(param)]] = per_param
                self._handles.append(param.register_post_accumulate_grad_hook(self._hook(per_param, group)))

    @staticmethod
    def _hook(per_param: torch.optim.Optimizer, group: dict) -> Any:
        def step(param: torch.Tensor) -> None:
            per_param.param_groups[0].update(_group_hyperparameters(group))  # follow LR schedules
            per_param.step()
            per_param.zero_grad(set_to_none=True)  # the point: this gradient is freed right now

        return step

    def remove(self) -> None:
        """Remove the hooks; gradients accumulate normally again."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def state_dict(self) -> dict[str, Any]:
        return {name: opt.state_dict() for name, opt in self.optimizers.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        unknown = sorted(set(state) - set(self.optimizers))
        if unknown:
            raise KeyError(f"StepInBackward.load_state_dict: no parameter named {unknown[:3]}")
        for name, opt_state in state.items():
            self.optimizers[name].load_state_dict(opt_state)


# ---------------------------------------------------------------------------------------------
# bitsandbytes optimizers on sharded (DTensor) parameters
# ---------------------------------------------------------------------------------------------
#: bitsandbytes' blockwise optimizers quantize their state in blocks of this many values, one fp32
#: scale (``absmax``) per block (``Optimizer2State.init_state``: ``blocksize = 256``).
BNB_BLOCKSIZE = 256

# State of a bitsandbytes optimizer that is one tensor per optimizer, identical on every rank (the
# quantization maps), and state with one value per block of the local shard.
_SHARED_STATE = ("qmap1", "qmap2")
_BLOCK_STATE = ("absmax1", "absmax2")
# In ``state_dict()`` only: how many shards the blocks were cut from, checked on load.
_SHARDS_KEY = "local_shards"


class LocalShardStep:
    """Mixin for a bitsandbytes optimizer: step each ``DTensor`` parameter's local shard.

    bitsandbytes' update kernels take plain tensors; FSDP2's parameters and gradients are
    ``DTensor`` s (``got mixed torch.Tensor and DTensor``). With this mixin first in the bases
    (``class AdamW8bitSharded(LocalShardStep, bnb.optim.AdamW8bit)``, or :func:`step_local_shards`
    on an existing optimizer), each rank

    * creates the state for its local shard (``param._local_tensor``): uint8 codes of the
      shard's size plus one fp32 ``absmax`` per block of :data:`BNB_BLOCKSIZE` values *of the
      shard*, so N ranks hold about 1/N of the state each. Whether a parameter gets 8-bit or
      32-bit state (``min_8bit_size``) is decided by the whole parameter's size, as without
      sharding;
    * steps the local shard with the local shard of the (already reduced) gradient, in place:
      the shard is FSDP2's own storage, so nothing is copied;
    * keeps the state keyed by the ``DTensor`` parameter, so ``optimizer.state``, the
      checkpoint code (``torch.distributed.checkpoint.state_dict``) and
      :mod:`lightning_mem.offload` find it as for any optimizer.

    Results: element-wise state (32-bit, or 8-bit codes against their block's scale) is the same
    function of the same numbers as without sharding, so on one rank (the local shard is the
    whole tensor) the step equals the unsharded one. On N ranks the blocks are cut from each
    shard rather than from the whole tensor, so the 8-bit state, and the update through it,
    differ from the unsharded step by bitsandbytes' blockwise rounding (a block's scale is the
    max over other values); 32-bit state steps equal the unsharded ones.

    ``state_dict()`` presents a sharded parameter's state as ``DTensor`` s, so a distributed
    checkpoint saves every rank's part and a full one gathers them: state of the parameter's
    shape (codes, 32-bit moments) with the parameter's own placements; block scales as one row
    per rank (padded to the largest shard's block count). ``load_state_dict`` takes them back.
    Restore such a checkpoint on the same number of ranks: blocks of other shards are other blocks.

    Refused: clipping each update by its norm (``max_unorm > 0``: LAMB, LARS) on a sharded
    parameter, whose norm no rank sees.
    """

    # NOTE: these override bitsandbytes' `Optimizer8bit` hooks (`init_state`, `update_step`,
    # `get_config`, `state_dict`, `load_state_dict`); its `step` loops over the parameters and
    # calls them, so the loop, paging and prefetching stay bitsandbytes' own.
    _whole_numel: Optional[int] = None

    @torch.no_grad()
    def init_state(self, group: dict, p: torch.Tensor, gindex: int, pindex: int) -> None:
        if not is_dtensor(p):
            return super().init_state(group, p, gindex, pindex)
        local = p._local_tensor
        self._whole_numel = p.numel()
        try:
            super().init_state(group, local, gindex, pindex)
        finally:
            self._whole_numel = None
        self.state[p] = self.state.pop(local)

    def get_config(self, gindex: int, pindex: int, group: dict) -> dict:
        config = super().get_config(gindex, pindex, group)
        if self._whole_numel is not None:
            # `init_state` compares the size of the tensor it is given (the shard) with
            # `min_8bit_size`; the whole parameter's size decides, as without sharding.
            config["min_8bit_size"] = 0 if self._whole_numel >= config["min_8bit_size"] else math.inf
        return config

    @torch.no_grad()
    def update_step(self, group: dict, p: torch.Tensor, gindex: int, pindex: int) -> None:
        if not is_dtensor(p):
            return super().update_step(group, p, gindex, pindex)
        local, state = p._local_tensor, self.state[p]
        if local.numel() == 0:  # this rank holds no part of `p` (fewer rows than ranks)
            state["step"] += 1
            return
        local.grad = local_tensor(p.grad)
        self.state[local] = state
        try:
            super().update_step(group, local, gindex, pindex)
        finally:
            del self.state[local]
            local.grad = None

    def state_dict(self) -> dict[str, Any]:
        state_dict = super().state_dict()
        params = list(chain.from_iterable(g["params"] for g in self.param_groups))
        for index, entry in state_dict["state"].items():
            if isinstance(entry, dict) and is_dtensor(params[index]) and _state_to_dtensors(entry, params[index]):
                entry[_SHARDS_KEY] = _shard_count(params[index])
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any], move_to_device: bool = True) -> None:
        saved = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = dict(zip(saved, chain.from_iterable(g["params"] for g in self.param_groups)))
        state = {}
        for key, entry in state_dict["state"].items():
            param = params.get(key)
            if isinstance(entry, dict) and param is not None and is_dtensor(param):
                entry = _state_to_local(entry, param)
                saved_shards = entry.pop(_SHARDS_KEY, None)
                if saved_shards is not None and saved_shards != _shard_count(param):
                    raise ValueError(
                        f"{type(self).__name__}: the 8-bit state of parameter {key} was saved cut into {int(saved_shards)} shards"
                        f" and this run cuts it into {_shard_count(param)}; bitsandbytes' blocks of {BNB_BLOCKSIZE} values"
                        " would not line up. Resume on the same number of (data-parallel) ranks.")
            state[key] = entry
        super().load_state_dict({**state_dict, "state": state}, move_to_device=move_to_device)
        self._share_quantization_maps()

    def _share_quantization_maps(self) -> None:
        # Loading copies the maps once per parameter; bitsandbytes' own state shares its
        # `name2qmap` tensors (one per device) with every parameter's `qmap1`/`qmap2`.
        shared = [t for t in getattr(self, "name2qmap", {}).values() if isinstance(t, torch.Tensor)]
        for entry in self.state.values():
            for key in _SHARED_STATE:
                value = entry.get(key)
                if not isinstance(value, torch.Tensor):
                    continue
                same = next((t for t in shared if t.device == value.device and t.shape == value.shape
                             and torch.equal(t, value)), None)
                if same is None:
                    shared.append(value)
                else:
                    entry[key] = same


def _shard_count(param: torch.Tensor) -> int:
    return math.prod(param.device_mesh.size(i) for i, pl in enumerate(param.placements) if splits(pl))


def _is_sharded(param: torch.Tensor) -> bool:
    return _shard_count(param) > 1


def _max_local_numel(param: torch.Tensor) -> int:
    """The most elements any rank's shard of ``param`` can hold: every placement splits a
    dimension like ``torch.chunk`` (ceil), so nested splits bound it by ceil(size / parts)."""
    parts = [1] * param.dim()
    for i, pl in enumerate(param.placements):
        if splits(pl):
            parts[pl.dim] *= param.device_mesh.size(i)
    return math.prod(-(-n // k) for n, k in zip(param.shape, parts))


def _dtensor(local: torch.Tensor, param: torch.Tensor, placements: tuple, shape: tuple) -> torch.Tensor:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    spec = DTensorSpec(param.device_mesh, tuple(placements), tensor_meta=TensorMeta(torch.Size(shape), stride, local.dtype))
    # NOTE: the constructor keeps a host shard on the host (FSDP2's CPU offload); from_local would move it.
    return DTensor(local, spec, requires_grad=False)


def _state_to_dtensors(entry: dict, param: torch.Tensor) -> bool:
    """In place: ``entry``'s local-shard tensors as DTensors (see :class:`LocalShardStep`).
    Returns whether it holds block state (8-bit)."""
    from torch.distributed.tensor import Replicate, Shard

    local_shape = param._local_tensor.shape
    blockwise = False
    for key, value in list(entry.items()):
        if isinstance(value, dict):  # bitsandbytes wraps its quantization state in a nested dict
            blockwise |= _state_to_dtensors(value, param)
        elif not isinstance(value, torch.Tensor) or is_dtensor(value) or key in _SHARED_STATE:
            continue
        elif key in _BLOCK_STATE:
            blocks = -(-_max_local_numel(param) // BNB_BLOCKSIZE)
            if value.shape[-1] > blocks:
                raise RuntimeError(f"LocalShardStep: `{key}` has {value.shape[-1]} blocks, more than the {blocks} a shard of"
                                   f" {tuple(param.shape)} makes in blocks of {BNB_BLOCKSIZE}; bitsandbytes' block size changed?")
            rows, blockwise = _shard_count(param), True
            padded = value.new_zeros((1, *value.shape[:-1], blocks))
            padded[0, ..., : value.shape[-1]] = value
            placements = [Shard(0) if splits(pl) else Replicate() for pl in param.placements]
            entry[key] = _dtensor(padded, param, placements, (rows, *value.shape[:-1], blocks))
        elif value.dim() >= len(local_shape) and value.shape[value.dim() - len(local_shape):] == local_shape:
            lead = value.dim() - len(local_shape)  # AdEMAMix keeps two moments in one (2, *shape) tensor
            placements = list(param.placements)
            if lead:
                if any(splits(pl) and type(pl) is not Shard for pl in placements):
                    raise NotImplementedError(f"LocalShardStep: `{key}` of shape {tuple(value.shape)} on {placements}")
                placements = [Shard(pl.dim + lead) if splits(pl) else pl for pl in placements]
            entry[key] = _dtensor(value, param, placements, (*value.shape[:lead], *param.shape))
    return blockwise


def _state_to_local(entry: dict, param: torch.Tensor) -> dict:
    """A copy of ``entry`` with DTensors from :func:`_state_to_dtensors` back as this rank's tensors."""
    out = {}
    for key, value in entry.items():
        if isinstance(value, dict):
            value = _state_to_local(value, param)
        elif is_dtensor(value):
            value = value.to_local()
            if key in _BLOCK_STATE:
                blocks = -(-param._local_tensor.numel() // BNB_BLOCKSIZE)
                value = value[0, ..., :blocks].clone()  # owns exactly its blocks (state bytes stay exact)
        out[key] = value
    return out


@functools.cache
def local_shard_class(cls: type) -> type:
    """``cls`` (a bitsandbytes optimizer class) with :class:`LocalShardStep` mixed in; same name."""
    if issubclass(cls, LocalShardStep):
        return cls
    return type(cls.__name__, (LocalShardStep, cls), {
        "__module__": __name__, "__qualname__": cls.__qualname__,
        "__doc__": f"{cls.__module__}.{cls.__qualname__} stepping DTensor parameters' local shards (LocalShardStep).",
    })


def is_bitsandbytes_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is one of bitsandbytes' optimizers (8-bit, 32-bit or paged)."""
    module = sys.modules.get("bitsandbytes.optim.optimizer")  # not loaded: it cannot be one
    return module is not None and isinstance(optimizer, module.Optimizer8bit)


def step_local_shards(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Make a bitsandbytes optimizer step its ``DTensor`` parameters' local shards, in place.

    The optimizer becomes an instance of :func:`local_shard_class` of its class (a subclass with
    :class:`LocalShardStep` first, same name; ``isinstance`` checks still hold, the object, its
    state and its schedulers are the same). Other optimizers are returned as they are: torch's
    optimizers step DTensors themselves. Call before the first step. Returns ``optimizer``.

    Raises:
        ValueError: the optimizer clips updates by their norm (``max_unorm``) and a parameter is
            sharded over several ranks.
    """
    if not is_bitsandbytes_optimizer(optimizer):
        return optimizer
    for gindex, group in enumerate(optimizer.param_groups):
        for pindex, param in enumerate(group["params"]):
            if is_dtensor(param) and _is_sharded(param) and optimizer.get_config(gindex, pindex, group)["max_unorm"] > 0:
                raise ValueError(
                    f"{type(optimizer).__name__} scales each update by the norm of the whole parameter (max_unorm="
                    f"{optimizer.get_config(gindex, pindex, group)['max_unorm']}), which no rank sees when FSDP2 shards"
                    " it: choose an optimizer without max_unorm (`model.optimizer` in the recipes), e.g."
                    " bitsandbytes.optim.AdamW8bit")
    optimizer.__class__ = local_shard_class(type(optimizer))
    return optimizer
