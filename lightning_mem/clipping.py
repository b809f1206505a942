"""Gradient clipping for any AdamW (fused, foreach, for-loop) under any precision that has no loss scaler.

Lightning clips through its precision plugin, and its mixed-precision plugin refuses every
optimizer that "performs unscaling of gradients internally" -- torch's fused AdamW and Adam -- even
under ``bf16-mixed``, which has no loss scaler and so nothing to unscale. The fused optimizer is the
fastest AdamW on a GPU (a few passes over each parameter where foreach makes about eight), and TRL's
default. :class:`ClipsGradients` makes a LightningModule clip through Lightning's own hook,
``configure_gradient_clipping`` (called after backward, before the optimizer step), with
:func:`clip_gradients`:

- **The total norm is computed once**, in float32, from per-tensor norms computed as one foreach
  call per device and dtype; the gradients are then scaled by one factor, again foreach.
- **Sharded gradients give the global norm.** A DTensor gradient (FSDP2, tensor parallelism) is
  reduced over the mesh dimensions it is sharded on, and only those: each group of gradients with
  the same mesh and placements costs one all-reduce of a scalar; replicated dimensions are not
  summed twice. Scaling touches each rank's local shard only.
- **No host sync**: the norm and the scale stay on the device; the norm is logged as a tensor
  (``grad_norm``), read by the logger after the step.

Where a loss scaler is in play (``16-mixed``), Lightning's plugin unscales the gradients before the
hook, and clipping stays Lightning's -- except with an optimizer that unscales inside its own step:
the gradients would be clipped while still scaled, so :class:`ClipsGradients` refuses that pairing
before the first step, naming the keys. DeepSpeed clips inside its engine (``gradient_clipping`` of
its config, from ``trainer.gradient_clip_val``): left to it. Manual optimization (PPO) calls
:func:`clip_module_gradients` where it would call ``LightningModule.clip_gradients``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from typing_extensions import override

from lightning_mem.offload import splits

#: Optimizer steps that unscale fp16 gradients themselves (torch's fused Adam/AdamW) say so this way.
_UNSCALES_ITSELF = "_step_supports_amp_scaling"


def _local(tensor: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _placement_key(grad: Tensor) -> Any:
    from torch.distributed.tensor import DTensor

    if not isinstance(grad, DTensor):
        return None
    return grad.device_mesh, tuple(grad.placements)


def _by_device_and_dtype(tensors: Iterable[Tensor]) -> dict[tuple[torch.device, torch.dtype], list[Tensor]]:
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = defaultdict(list)
    for t in tensors:
        groups[(t.device, t.dtype)].append(t)
    return groups


#: Elements per slice when a low-precision gradient's norm is taken off CUDA (16 MiB in float32).
NORM_SLICE = 1 << 22


def _norm_inputs(group: list[Tensor], device: torch.device, dtype: torch.dtype) -> list[Tensor]:
    """The tensors to take float32 norms of: ``group`` itself where the foreach kernel accumulates in
    float32 without a copy (CUDA, or float32 gradients), else flat slices of at most
    :data:`NORM_SLICE` elements. Off CUDA, ``_foreach_norm(..., dtype=float32)`` falls back to one
    ``vector_norm`` per tensor, which casts the whole tensor first: a bf16 embedding gradient of
    Qwen2.5-0.5B (151,936 x 896) became a 0.51 GiB float32 copy at every clip, the step's peak on a
    CPU. Sliced, the copy is one slice; the joint norm is the same sum (or max) over the pieces."""
    if device.type == "cuda" or dtype == torch.float32:
        return group
    return [piece for t in group for piece in (t.reshape(-1).split(NORM_SLICE) if t.is_contiguous() else (t,))]


def _local_power_sum(locals_: list[Tensor], norm_type: float) -> Tensor:
    """sum(|g|^p) over every element of ``locals_`` (max |g| for p = inf), in float32, on the first
    tensor's device: one foreach norm per device and dtype."""
    device = locals_[0].device
    parts = []
    for (dev, dtype), group in _by_device_and_dtype(locals_).items():
        norms = torch._foreach_norm(_norm_inputs(group, dev, dtype), norm_type, dtype=torch.float32)
        stacked = torch.stack(norms).to(device)
        parts.append(stacked.max() if math.isinf(norm_type) else stacked.pow(norm_type).sum())
    joined = torch.stack(parts)
    return joined.max() if math.isinf(norm_type) else joined.sum()


def gradient_norm(grads: list[Tensor], norm_type: float = 2.0) -> Tensor:
    """The ``norm_type``-norm of all of ``grads`` together, as a float32 scalar on the first gradient's
    device; for DTensors (FSDP2, tensor parallelism) the norm of the whole tensors, identical on every
    rank of their mesh (one scalar all-reduce per mesh and placements)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    if not grads:
        raise ValueError("no gradients to measure")
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"norm_type must be positive, got {norm_type}")
    groups: dict[Any, list[Tensor]] = defaultdict(list)
    for g in grads:
        groups[_placement_key(g)].append(g)
    reduce_op = "max" if math.isinf(norm_type) else "sum"
    device = _local(grads[0]).device
    totals = []
    for key, group in groups.items():
        local = _local_power_sum([_local(g) for g in group], norm_type)
        if key is not None:
            mesh, placements = key
            if any(p.is_partial() for p in placements):
                raise ValueError("a gradient is a DTensor with a pending (partial) reduction: clip after it is reduced")
            # Summed (or maxed) over the mesh dimensions the gradients are split on (Shard, and the
            # _StridedShard of FSDP2 over tensor parallelism), kept as is over those that replicate them.
            spec = [Partial(reduce_op) if splits(p) else Replicate() for p in placements]
            local = DTensor.from_local(local, mesh, spec, run_check=False).full_tensor()
        totals.append(local.to(device))
    total = torch.stack(totals)
    return total.max() if math.isinf(norm_type) else total.sum().pow(1.0 / norm_type)


def clip_by_norm(grads: list[Tensor], max_norm: float, norm_type: float = 2.0, eps: float = 1e-6) -> Tensor:
    """Scale ``grads`` in place so that their joint norm is at most ``max_norm``; returns the norm
    they had (float32 scalar, on the device: nothing is read back to the host)."""
    total = gradient_norm(grads, norm_type)
    scale = torch.clamp(max_norm / (total + eps), max=1.0)
    for (device, dtype), group in _by_device_and_dtype(_local(g) for g in grads).items():
        torch._foreach_mul_(group, scale.to(device=device, dtype=dtype))
    return total


def clip_by_value(grads: list[Tensor], clip_value: float) -> None:
    """Clamp every element of ``grads`` into ``[-clip_value, clip_value]`` in place (on local shards)."""
    for _, group in _by_device_and_dtype(_local(g) for g in grads).items():
        torch._foreach_clamp_min_(group, -clip_value)
        torch._foreach_clamp_max_(group, clip_value)


def optimizer_gradients(optimizer: Any) -> list[Tensor]:
    """The gradients the optimizer will step with (parameters without one are skipped)."""
    return [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


def clip_gradients(optimizer: Any, clip_val: float, algorithm: str = "norm") -> Tensor | None:
    """Clip the gradients of ``optimizer``'s parameters: ``algorithm`` ``"norm"`` (returns the total
    norm before clipping) or ``"value"`` (returns None). ``clip_val`` 0 or None clips nothing."""
    algorithm = str(getattr(algorithm, "value", algorithm)).lower()
    if algorithm not in ("norm", "value"):
        raise ValueError(f"gradient clipping algorithm must be 'norm' or 'value', got {algorithm!r}")
    if not clip_val or clip_val <= 0:
        return None
    grads = optimizer_gradients(optimizer)
    if not grads:
        return None
    if algorithm == "value":
        clip_by_value(grads, float(clip_val))
        return None
    return clip_by_norm(grads, float(clip_val))


# -- Lightning glue ------------------------------------------------------------------------------


def _scaler_of(trainer: Any) -> Any:
    return getattr(trainer.precision_plugin, "scaler", None)


def clips_itself(trainer: Any) -> bool:
    """Whether :func:`clip_module_gradients` clips (True) or leaves it to Lightning's plugin: it does
    under every precision without a loss scaler, on one device, DDP and FSDP2/ModelParallel; not
    under DeepSpeed (its engine clips) nor where a scaler unscales first (``16-mixed``)."""
    from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
    from lightning.pytorch.strategies import DeepSpeedStrategy

    if isinstance(trainer.strategy, DeepSpeedStrategy) or _scaler_of(trainer) is not None:
        return False
    plugin = trainer.precision_plugin
    return type(plugin) is Precision or isinstance(plugin, (MixedPrecision, HalfPrecision, DoublePrecision))


def check_clipping_supported(trainer: Any, optimizers: Iterable[Any], *, clip_key: str = "trainer.gradient_clip_val") -> None:
    """Refuse an optimizer that unscales inside its step (``fused: true``) under a loss scaler
    (``16-mixed``) when gradients are clipped: they would be clipped while still scaled."""
    if _scaler_of(trainer) is None:
        return
    for optimizer in optimizers:
        if getattr(optimizer, _UNSCALES_ITSELF, False):
            raise ValueError(
                f"{clip_key} with trainer.precision={trainer.precision!r} and {type(optimizer).__name__}(fused=True):"
                " the fused step unscales the fp16 loss scale inside itself, so gradients cannot be clipped"
                " before it. Use trainer.precision bf16-mixed (no loss scale), or"
                " model.optimizer.init_args.fused false, or no clipping"
            )


def clip_module_gradients(module: Any, optimizer: Any, clip_val: float | None, algorithm: str | None = "norm") -> Tensor | None:
    """Clip ``optimizer``'s gradients for a LightningModule (automatic or manual optimization):
    :func:`clip_gradients` where :func:`clips_itself`, else Lightning's ``module.clip_gradients``.
    Returns the norm before clipping when this module clipped by norm."""
    trainer = module.trainer
    algorithm = algorithm or "norm"
    if not clips_itself(trainer):
        check_clipping_supported(trainer, [optimizer])
        module.clip_gradients(optimizer, gradient_clip_val=clip_val, gradient_clip_algorithm=str(getattr(algorithm, "value", algorithm)))
        return None
    return clip_gradients(optimizer, clip_val or 0.0, algorithm)


class ClipsGradients:
    """LightningModule mixin: ``trainer.gradient_clip_val`` / ``gradient_clip_algorithm`` work with any
    optimizer, fused AdamW included, under every precision without a loss scaler (see the module).

    Put it before ``LightningModule`` in the bases. The gradient norm (before clipping) is logged
    once per optimizer step as ``grad_norm`` when clipping by norm.
    """

    @override
    def on_train_start(self) -> None:
        super().on_train_start()  # type: ignore[misc]
        if self.trainer.gradient_clip_val:  # type: ignore[attr-defined]
            check_clipping_supported(self.trainer, self.trainer.optimizers)  # type: ignore[attr-defined]

    @override
    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: float | None = None,
                                    gradient_clip_algorithm: str | None = None) -> None:
        norm = clip_module_gradients(self, optimizer, gradient_clip_val, gradient_clip_algorithm)
        if norm is not None:
            self.log("grad_norm", norm.detach(), on_step=True, on_epoch=False)  # type: ignore[attr-defined]
