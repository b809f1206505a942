"""Optimizer helpers: parameter groups, state accounting, paged-optimizer checks, step-in-backward.

Recipes take ``optimizer: OptimizerCallable``, so ``torch.optim.AdamW``,
``bitsandbytes.optim.AdamW8bit``, ``bitsandbytes.optim.PagedAdamW8bit`` and
``bitsandbytes.optim.PagedAdamW32bit`` are a YAML swap; the helpers here are what a recipe calls
around that callable.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch
from lightning.pytorch.utilities.rank_zero import WarningCache
from torch import nn

from lightning_mem.offload import is_dtensor, local_tensor, optimizer_state_slots
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


class StepInBackward:
    """Step each parameter as soon as its gradient is complete, then free that gradient.

    One optimizer of the same class per parameter is built from ``optimizer`` (its constructor
    defaults and the hyperparameters of the parameter's group) and stepped from the parameter's
    post-accumulate-grad hook. At most one parameter's gradient is alive at a time, instead of
    all of them between backward and ``optimizer.step()``. ``optimizer`` itself keeps no state:
    its parameters never have a gradient when it steps, so stepping it does nothing. Learning
    rate changes on ``optimizer`` (schedulers) are copied to the per-parameter optimizers before
    every step.

    Limits, by construction: no gradient accumulation (each backward steps), no clipping by the
    global gradient norm (no moment where all gradients exist), a single device (no reduction of
    gradients across ranks before the step).

    Args:
        module: the model whose parameters ``optimizer`` holds (names key the state dict).
        optimizer: the optimizer as configured; its class must take every constructor argument
            from ``optimizer.defaults`` (torch.optim optimizers do).
    """

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        cls = type(optimizer)
        signature = inspect.signature(cls)
        missing = [
            n for n, p in signature.parameters.items()
            if n != "params" and p.kind is not p.VAR_KEYWORD and n not in optimizer.defaults
        ]
        if missing:
            raise ValueError(
                f"StepInBackward rebuilds {cls.__name__} per parameter from `optimizer.defaults`, which lacks "
                f"{missing}: those settings would be lost. Use a torch.optim optimizer (e.g. torch.optim.AdamW)."
            )
        kwargs = {k: v for k, v in optimizer.defaults.items() if k in signature.parameters}
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

