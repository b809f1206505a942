"""One autocast copy per input: linear layers that read the same fp32 tensor share its bf16 cast.

Under ``bf16-mixed`` (autocast over fp32 weights) a transformer block's RMSNorm returns fp32, and
each linear layer that reads it casts it to bf16 again: the query, key and value projections make
three bf16 copies of one normalized tensor, the gate and up projections two, and autograd keeps
every copy for its layer's weight gradient. At 8 x 1,024 tokens that is three redundant
``[tokens, hidden]`` bf16 tensors a block held until backward (1.0 GiB over Qwen2.5-0.5B's 24
blocks, 2.0 GiB over 1.5B's 28), and three redundant casts a block each way.

:func:`share_input_casts` gives each plain ``nn.Linear`` a forward that, under autocast, looks up
the cast of its input made by an earlier layer in the same forward (the same tensor object, not
modified since) and reads that one; only the first reader casts. The numbers do not change: every
layer still multiplies the same bf16 values, autocast still casts its weight, and each reader's
gradient reaches the fp32 input through its own cast node (:class:`_SharedCast`, the same
``grad.to(fp32)`` as autocast's), so the readers' gradients are summed in fp32 as before, not in
bf16.

Nothing changes where there is nothing to share: outside autocast, an input already in the compute
dtype, a distributed tensor (tensor/sequence parallel), under ``torch.inference_mode`` (nothing is
kept for a backward), or inside ``torch.compile`` (whose graph makes one cast of a value anyway).
"""

from __future__ import annotations

import types
import weakref

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor

#: id(input) -> (weak input, its version, weak cast). Weak both ways: an entry holds nothing alive;
#: the cast lives as long as a layer's saved tensors use it.
_CASTS: dict[int, tuple[weakref.ref, int, weakref.ref]] = {}


class _SharedCast(torch.autograd.Function):
    """``cast`` (a bf16 copy of ``x``) as a differentiable function of ``x``: one node per reader,
    whose backward is autocast's (the gradient cast back to ``x``'s dtype)."""

    @staticmethod
    def forward(ctx, x: Tensor, cast: Tensor) -> Tensor:  # noqa: ANN001
        ctx.dtype = x.dtype
        return cast.view_as(cast)  # the shared storage, not a copy

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # noqa: ANN001
        return grad.to(ctx.dtype), None


def _forget(key: int, ref: weakref.ref) -> None:
    entry = _CASTS.get(key)
    if entry is not None and entry[0] is ref:
        del _CASTS[key]


def shared_cast(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x`` in ``dtype``: the copy an earlier call made of this same ``x`` (unmodified since) if it is
    still alive, else a new one. Differentiable with respect to ``x``."""
    key = id(x)
    entry = _CASTS.get(key)
    cast = None
    if entry is not None:
        ref, version, cast_ref = entry
        if ref() is x and version == x._version:
            cast = cast_ref()
    if cast is None or cast.dtype != dtype:
        with torch.no_grad():
            cast = x.detach().to(dtype)
        ref = weakref.ref(x, lambda r, k=key: _forget(k, r))
        _CASTS[key] = (ref, x._version, weakref.ref(cast))
    if not (torch.is_grad_enabled() and x.requires_grad):
        return cast
    return _SharedCast.apply(x, cast)


def _linear_forward(self: nn.Linear, x: Tensor) -> Tensor:
    # nn.Linear.forward, reading the shared cast of an fp32 input under autocast (the checks in the
    # order that leaves the common cases first: this runs for every linear layer of every forward).
    if x.dtype is torch.float32 and torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        # Inference tensors (Lightning's validation runs under inference_mode) keep no version to
        # check, and nothing for a backward: autocast's own casts are as good there.
        if dtype is not torch.float32 and (type(x) is Tensor or isinstance(x, FakeTensor)) \
                and not torch.compiler.is_compiling() and not x.is_inference():
            x = shared_cast(x, dtype)
    return F.linear(x, self.weight, self.bias)


def share_input_casts(model: nn.Module) -> int:
    """Give every plain ``nn.Linear`` in ``model`` (also one FSDP2 has wrapped) the sharing forward;
    returns how many layers have it. Subclasses with a forward of their own (LoRA, 4-bit) are left
    alone, their inner ``nn.Linear`` layers are not; so is a layer whose instance already has a
    forward of its own (accelerate's device-map hooks load its weight in that forward). Calling it
    again changes nothing."""
    count = 0
    for module in model.modules():
        if not isinstance(module, nn.Linear) or type(module).forward is not nn.Linear.forward:
            continue
        own = module.__dict__.get("forward")
        if own is None:
            module.forward = types.MethodType(_linear_forward, module)
        elif getattr(own, "__func__", None) is not _linear_forward:
            continue  # a forward set on the instance by someone else (accelerate's offload hooks): theirs
        count += 1
    return count


def unshare_input_casts(model: nn.Module) -> int:
    """Undo :func:`share_input_casts`; returns how many layers it restored."""
    count = 0
    for module in model.modules():
        if getattr(module.__dict__.get("forward"), "__func__", None) is _linear_forward:
            del module.forward
            count += 1
    return count
