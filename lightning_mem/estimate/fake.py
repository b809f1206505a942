"""Fake tensors where the recipe's code expects real ones: config-only weights, fake bitsandbytes
``Params4bit``, parameter swaps and activation offload's choice of what to stash.

The estimate's fit runs under :class:`~lightning_mem.estimate.tracker.TrackingMode` (fake
tensors); these are the places where library code (bitsandbytes, ``torch.utils.swap_tensors``,
:class:`~lightning_mem.activation_offload.ActivationOffloader`) needs telling how to treat them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from lightning_mem.estimate.tracker import MemoryLedger

def swap_or_set_data(swap: Callable) -> Callable:
    # ``Module.to``/``_apply`` always swaps fake parameters, which fails when anything holds a weak
    # reference to them (fake tensor caches do); giving the parameter the new data is the same here.
    def inner(t1: torch.Tensor, t2: torch.Tensor) -> None:
        try:
            swap(t1, t2)
        except RuntimeError:
            t1.data = t2.data

    return inner


def fake_only_stash(ledger: MemoryLedger) -> Callable[[Callable], Callable]:
    """ActivationOffloader's choice of what to stash, for fake tensors.

    Its own check keeps FakeTensor (by exact type) and parameters (by data pointer, which is 0 for
    every fake storage) in place. For a fake tensor the same rules are applied here, with the
    ledger's category standing in for the pointer test. The saved integer tensors (token ids,
    positions) are real CPU tensors whose storage cannot be re-viewed as a fake byte buffer: they
    stay in place (a few KB per layer).
    """

    def wrap(should_stash: Callable) -> Callable:
        def inner(self: Any, tensor: torch.Tensor) -> bool:
            from torch._subclasses.fake_tensor import FakeTensor

            if not isinstance(tensor, FakeTensor):
                return False
            if tensor.layout is not torch.strided or tensor.device.type != self.device.type:
                return False
            if tensor.is_leaf and tensor.requires_grad:
                return False
            base = tensor._base
            if base is not None and base.is_leaf and base.requires_grad:
                return False
            if ledger.category_of(tensor) == "weights":
                return False
            nbytes = tensor.untyped_storage().nbytes()
            return nbytes > 0 and nbytes >= self.min_bytes

        return inner

    return wrap


@contextlib.contextmanager
def weights_source(fake: bool) -> Iterator[None]:
    """Where a config-only base's weights come from: on fake tensors, from its config alone.

    A LoRA or QLoRA recipe gives a config-only base seeded random weights on disk and reads them
    back (quantizing as it reads); fake tensors can be neither written nor read, so inside
    :func:`~lightning_mem.models.config_only_models` the same ``configure_model`` builds the base
    from its config (and quantizes it with bitsandbytes' own ops). A real-tensor run (the accuracy
    tests) takes the recipe's disk path, inside the estimate's temporary folder.
    """
    from lightning_mem.models import config_only_models

    if not fake:
        yield
        return
    with config_only_models(), _fake_params4bit():
        yield


@contextlib.contextmanager
def _fake_params4bit() -> Iterator[None]:
    """Let bitsandbytes' ``Params4bit`` wrap a fake tensor.

    ``Params4bit(data)`` re-types ``data`` in place (``Tensor._make_subclass``), which a FakeTensor
    (itself a subclass) refuses. For fake data it becomes an instance of a class that is both:
    FakeTensor for dispatch (shapes, dtypes, the fake device), Params4bit for everything else, its
    attributes set as ``Params4bit.__new__`` sets them. Quantization, the forward's dequantization
    and the matmul then run bitsandbytes' own code and fake kernels, so the packed weight and its
    quantization state have the shapes and dtypes a real load gives.
    """
    try:
        import bitsandbytes as bnb
    except ImportError:
        yield
        return
    params4bit = bnb.nn.Params4bit
    original = params4bit.__new__
    params4bit.__new__ = _fake_params4bit_new(params4bit, original)
    # bitsandbytes caches the code of its nested (double) quantization in a module-level dict on
    # first use; made inside the estimate it would be a fake tensor's leftovers, and every later
    # real quantization in the process would quantize the absmax with it (different bytes).
    qmaps = bnb.functional.name2qmap
    cached = dict(qmaps)
    try:
        yield
    finally:
        params4bit.__new__ = original
        qmaps.clear()
        qmaps.update(cached)


def _fake_params4bit_new(params4bit: type, original: Callable[..., Any]) -> Callable[..., Any]:
    """A ``Params4bit.__new__`` that makes fake data an instance of a class both FakeTensor and
    Params4bit (see :func:`_fake_params4bit`); real data goes to ``original``."""
    from torch._subclasses.fake_tensor import FakeTensor

    attributes = ("blocksize", "compress_statistics", "quant_type", "quant_state", "quant_storage",
                  "bnb_quantized", "module")

    def detach(self: Any) -> Any:
        # Still a Params4bit: moving a module (``Module.to``) rebuilds its parameters with
        # ``Parameter(param_applied)``, which asks ``detach()`` for the same class.
        out = FakeTensor.detach(self)
        out.__class__ = type(self)
        for name in attributes:
            setattr(out, name, getattr(self, name, None))
        return out

    fake_class = type("Params4bit", (FakeTensor, params4bit), {"__module__": __name__, "detach": detach})

    def new(cls: type, data: torch.Tensor | None = None, requires_grad: bool = False, quant_state: Any = None,
            blocksize: int | None = None, compress_statistics: bool = True, quant_type: str = "fp4",
            quant_storage: torch.dtype = torch.uint8, module: Any = None, bnb_quantized: bool = False,
            **kwargs: Any) -> Any:
        if not isinstance(data, FakeTensor):
            return original(cls, data, requires_grad, quant_state, blocksize, compress_statistics, quant_type,
                            quant_storage, module, bnb_quantized, **kwargs)
        self = data.detach()  # a new fake tensor on the same (fake) storage
        self.__class__ = fake_class
        self.requires_grad = requires_grad
        self.blocksize = 64 if blocksize is None else blocksize
        self.compress_statistics = compress_statistics
        self.quant_type = quant_type
        self.quant_state = quant_state
        self.quant_storage = quant_storage
        self.bnb_quantized = bnb_quantized
        self.module = module
        return self

    return new
