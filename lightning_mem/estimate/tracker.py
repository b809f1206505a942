"""Count the bytes of live tensors, by category, while real code runs on real or fake tensors.

:class:`TrackingMode` is the ``TorchDispatchMode`` that feeds the ledger
(:class:`~lightning_mem.estimate.ledger.MemoryLedger`: bytes per storage and category, the device
peak) with every tensor an operator returns. With ``fake=True`` it also makes the step run without memory: floating tensors
(weights, activations, logits, caches) are ``FakeTensor``\\ s -- shapes and dtypes only -- while
small integer and boolean tensors (token ids, masks, lengths) and scalars made from nothing stay real, so the Python control flow
of ``generate``, micro-batching and masking runs as it does for real. An integer result of a fake
computation (``argmax``/``multinomial`` of fake logits) is made real with a fixed value: the
``fill_token`` for sampled tokens (the estimator picks one that is not an end-of-sequence token,
so every response is as long as the config allows -- the worst case), 0 or ``False`` otherwise.
A Python scalar read from a fake tensor (``loss.item()``) is 0.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_mem.estimate.fake_ops import (
    CPU,
    DECLINED,
    UNSAFE_VIEW,
    FakeMaker,
    NotOnMeta,
    Written,
    fake_mode_runs_meta,
    key_of,
    layout_of,
    leaves_of,
    map_leaves,
    meta_call,
    place_of,
    rebuild,
    returns_written,
    written,
)
from lightning_mem.estimate.ledger import CATEGORIES, HOST, MemoryLedger

# The ledger and the argument walk keep their old home's names (``from ...tracker import ...``).
__all__ = ["CATEGORIES", "HOST", "REAL_FLOAT_INPUT_NUMEL", "REAL_INT_NUMEL", "MemoryLedger", "TrackingMode",
           "leaves_of", "map_leaves"]

# Integer/bool tensors up to this many elements are computed for real in fake mode.
REAL_INT_NUMEL = 1 << 24
# Token ids, positions, masks and lengths; not uint8/int8, which hold quantized weights and state.
_REAL_DTYPES = {torch.int64, torch.int32, torch.bool}
_SAMPLING_OPS = {"argmax", "multinomial", "argmin"}
# An operator on real tensors only is computed for real (its integers are the run's token ids and
# lengths) unless an input has more elements than this and its output is floating: then it runs
# fake. A float tensor made from real masks (transformers' sdpa turns the real [rows, 1, L, L]
# boolean mask into a bf16 one with ``torch.where``) has only fake consumers, and computing it cost
# a quarter of a PPO estimate's time.
REAL_FLOAT_INPUT_NUMEL = 1 << 20

_DEVICE_QUERY = torch.ops.prim.device.default


def _is_fake(x: Any) -> bool:
    return isinstance(x, FakeTensor)


def _broadcasts_large(func: Any, tensors: list[torch.Tensor]) -> bool:
    """Whether pointwise ``func`` broadcasts its inputs to more than :data:`REAL_INT_NUMEL` elements:
    transformers builds a ``[rows, 1, L, L]`` boolean attention mask from ``L``-long ranges and the
    ``[rows, L]`` padding mask (gigabytes at a packed 16k-token row), which only fake attention reads."""
    if len(tensors) < 2 or torch.Tag.pointwise not in func.tags:
        return False
    try:
        return math.prod(torch.broadcast_shapes(*(t.shape for t in tensors))) > REAL_INT_NUMEL
    except RuntimeError:
        return False


class TrackingMode(TorchDispatchMode):
    """Feed every operator output to ``ledger``; with ``fake=True`` run floating math on fake tensors."""

    def __init__(self, ledger: MemoryLedger, *, fake: bool = False, fill_token: int = 0,
                 fixed_sampling: bool | None = None) -> None:
        super().__init__()
        self.ledger = ledger
        self.fake = fake
        self.fill_token = fill_token
        #: Sampling operators return ``fill_token`` everywhere, on real tensors too (the estimate's
        #: real-tensor runs then sample what its fake ones do). Default: with ``fake``.
        self.fixed_sampling = fake if fixed_sampling is None else fixed_sampling
        self.fake_mode = None
        if fake:
            self.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
            self._make_fake = FakeMaker(self.fake_mode)
        #: This run's cache of fake results (:meth:`_fake_dispatch`): operator and argument layouts
        #: to output layouts.
        self._op_cache: dict[Any, Any] = {}
        #: Per operator: whether its meta kernel gives the fake mode's result (:func:`fake_mode_runs_meta`).
        self._runs_meta: dict[Any, bool] = {}

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # TorchDispatchMode wraps a subclass's __torch_dispatch__ in torch._disable_dynamo unless this
        # says no: a wrapper of two calls and four frame-evaluation switches (about 5 us) around each
        # of the hundred thousand operators an estimate dispatches. The estimate never runs under
        # torch.compile (its decode loop runs eager: rl/decode.estimated_decode).
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func is _DEVICE_QUERY and type(args[0]) is FakeTensor:
            # ``t.device`` of a fake tensor: most of the operators a fake step dispatches (six in
            # ten) are this query, which allocates nothing and which the fake tensor answers itself.
            return args[0].fake_device
        kwargs = kwargs or {}
        out = self._run(func, args, kwargs) if self.fake else func(*args, **kwargs)
        if self.fixed_sampling and not self.fake and func.overloadpacket.__name__ in _SAMPLING_OPS:
            out = map_leaves(lambda t: self._realize(t, self.fill_token), out)
        for t in leaves_of(out):
            if isinstance(t, torch.Tensor):
                self.ledger.track(t)
        return out

    # -- fake execution with real integers ------------------------------------------------------
    def _run(self, func, args, kwargs):  # noqa: ANN001
        leaves = leaves_of((args, kwargs))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        has_fake = any(_is_fake(x) for x in tensors)
        # ``isinstance``: the estimate's fake Params4bit is a FakeTensor subclass (estimate/fake.py).
        if (func.is_view or func is UNSAFE_VIEW) and tensors and all(
            isinstance(x, FakeTensor) and x.fake_mode is self.fake_mode and x.constant is None for x in tensors
        ):
            return self._view_on_meta(func, args, kwargs, tensors[0].fake_device)
        name = func.overloadpacket.__name__
        if name == "_local_scalar_dense" and has_fake:
            t = args[0]
            return False if t.dtype == torch.bool else (0.0 if t.is_floating_point() or t.is_complex() else 0)
        if name == "set_" and _is_fake(args[0]) and any(
            isinstance(x, torch.UntypedStorage) and x.device.type != "meta" for x in leaves
        ):
            # A fake tensor cannot view real bytes. Only copying a real storage does this here
            # (torchmetrics deep-copies a logged metric's default): the copy is left unfilled, and
            # the estimate reads no logged value.
            return args[0]
        if tensors and not has_fake:  # all inputs real: compute for real, unless what it makes is large
            if max(x.numel() for x in tensors) > REAL_FLOAT_INPUT_NUMEL or _broadcasts_large(func, tensors):
                fake_out = self._large_on_meta(func, args, kwargs)
                if fake_out is not None:
                    return fake_out
            return func(*args, **kwargs)
        if any(isinstance(x, torch.UntypedStorage) for x in leaves):
            # Not through the fake mode's op cache: its key would hold the storage (and so every
            # tensor on it) alive for the rest of the run -- activation offload's byte views of
            # what it stashes would then never be freed.
            cached, self.fake_mode.cache_enabled = self.fake_mode.cache_enabled, False
            try:
                with self.fake_mode:
                    fake_out = func(*args, **kwargs)
            finally:
                self.fake_mode.cache_enabled = cached
        else:
            # The fake mode's own handler is called (in _fake_dispatch) as the dispatcher would call
            # it with the mode entered: entering and leaving the mode for each operator cost as
            # much as the walk of its arguments did.
            fake_out = self._fake_dispatch(func, args, kwargs, tensors, leaves)
        if func._schema.is_mutable and tensors and not _is_fake(args[0]) and isinstance(args[0], torch.Tensor):
            return args[0]  # a real tensor written with fake values: it keeps its (worst-case) values
        if not tensors:  # a factory: small integer tensors are made for real
            return map_leaves(lambda t: self._realize_factory(func, args, kwargs, t), fake_out)
        fill = self.fill_token if name in _SAMPLING_OPS else 0
        return map_leaves(lambda t: self._realize(t, fill), fake_out)

    def _fake_dispatch(self, func, args, kwargs, tensors, leaves):  # noqa: ANN001
        """The fake mode's result of ``func`` on arguments with a fake tensor (or none), from a cache of this
        run's own, else from ``func``'s meta kernel where that is what the fake mode runs, else from
        the fake mode.

        The fake mode keys its cache on the whole metadata of every argument (a third of an
        estimate's time), and converts each real input on every call. This cache keys on what the
        estimate's operators vary in: the operator, the default dtype and inference mode, each
        tensor's shape, strides, dtype, device, offset and ``requires_grad``, and the other
        arguments. It keeps what the meta path made (:meth:`_on_meta`: a result there depends on
        layouts only, as meta tensors have no values), and of the fake mode's results only those
        of fake inputs that the fake mode itself cached (a hit or a stored miss, not a bypass).
        It keeps only new, separate, offset-free outputs, and makes them as the fake mode does (an
        empty meta tensor of the recorded layout, wrapped as fake); of an in-place operator it
        keeps which inputs it returns.
        """
        mode = self.fake_mode
        runs_meta = self._runs_meta.get(func)
        if runs_meta is None:
            runs_meta = self._runs_meta[func] = fake_mode_runs_meta(mode, func)
        # Fake tensors of this mode (the fake Params4bit too: a subclass) and plain real tensors: their
        # layouts decide the result wherever the fake mode caches it, or the meta path runs it.
        keyable = all(
            (x.fake_mode is mode and x.constant is None) if isinstance(x, FakeTensor)
            else (type(x) is torch.Tensor or type(x) is nn.Parameter)
            for x in tensors
        )
        mutable = func._schema.is_mutable
        key = None
        if keyable and (runs_meta or not mutable or returns_written(func)):
            try:
                # The global state the fake mode's own key holds that can change an output's layout.
                key = (func, torch.get_default_dtype(), torch.is_inference_mode_enabled(), key_of(args),
                       key_of(kwargs))
                entry = self._op_cache.get(key)
            except TypeError:  # an unhashable argument
                key, entry = None, None
            if entry is not None:
                return entry.outputs(leaves) if type(entry) is Written else rebuild(self._make_fake, entry)
        if runs_meta:
            out = self._on_meta(func, args, kwargs, tensors)
            if out is not DECLINED:
                if key is not None:
                    entry = Written.of(out, leaves) if mutable else layout_of(out, tensors)
                    if entry is not None:
                        self._op_cache[key] = entry
                return out
        return self._from_fake_mode(func, args, kwargs, tensors, leaves, key)

    def _from_fake_mode(self, func, args, kwargs, tensors, leaves, key):  # noqa: ANN001
        """The fake mode's own result of ``func``, kept in the run's cache under ``key`` (if any) where
        it stands for every call with the same layouts (:meth:`_fake_dispatch`)."""
        mode = self.fake_mode
        if key is not None and func._schema.is_mutable:  # an in-place operator with a fake kernel of its own
            before = [place_of(x) for x in tensors]
            out = mode.__torch_dispatch__(func, (), args, kwargs)
            # Its outputs are inputs it wrote, each as itself, and it left every input's layout as it
            # was: another call with the same layouts returns the same inputs.
            entry = Written.of(out, leaves)
            if entry is not None and before == [place_of(x) for x in tensors]:
                self._op_cache[key] = entry
            return out
        hits, misses = FakeTensorMode.cache_hits, FakeTensorMode.cache_misses
        out = mode.__torch_dispatch__(func, (), args, kwargs)
        if key is not None and FakeTensorMode.cache_hits + FakeTensorMode.cache_misses == hits + misses + 1:
            entry = layout_of(out, tensors)
            if entry is not None:
                self._op_cache[key] = entry
        return out

    def _view_on_meta(self, func, args, kwargs, device):  # noqa: ANN001
        """A view of fake tensors, as the fake mode makes it but without its operator cache: the
        view's meta kernel on the fake tensors' own meta storage, wrapped as fake. A view allocates
        nothing; its key in the cache cost three times the kernel (views are a third of the
        operators a step dispatches)."""
        out = meta_call(self.fake_mode, func, args, kwargs)
        if type(out) is torch.Tensor:  # most views: one tensor
            return self._make_fake(out, device)
        return map_leaves(lambda t: self._make_fake(t, device) if isinstance(t, torch.Tensor) else t, out)

    def _on_meta(self, func, args, kwargs, tensors):  # noqa: ANN001
        """``func`` of this mode's fake tensors and real tensors, all on the CPU, by its meta kernel
        (:func:`fake_mode_runs_meta`), as the fake mode would run it: each real input as an empty
        meta tensor of its layout, each new output wrapped as a fake CPU tensor, a written input
        returned as itself. ``DECLINED`` where the fake mode must decide (another device, a tensor
        subclass, a written real tensor, an output that is a real input's stand-in). The fake mode's own path
        costs 100-1,000 us an operator in checks, cache keys and conversions of real inputs; this
        one 10-20 us."""
        mode, cpu = self.fake_mode, CPU
        stand_ins = None
        for x in tensors:
            if isinstance(x, FakeTensor):
                if x.fake_mode is not mode or x.constant is not None or x.fake_device != cpu:
                    return DECLINED
            elif (type(x) is torch.Tensor or type(x) is nn.Parameter) and x.device == cpu:
                stand_ins = stand_ins or {}
                stand_ins[id(x)] = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
            else:
                return DECLINED
        if stand_ins is not None:
            if func._schema.is_mutable and any(id(x) in stand_ins for x in written(func, args, kwargs)):
                return DECLINED  # a real tensor written: the fake mode's rule (it keeps its values)
            meta = lambda x: stand_ins.get(id(x), x) if isinstance(x, torch.Tensor) else x  # noqa: E731
            args, kwargs = map_leaves(meta, (args, kwargs))
            ids = {id(v) for v in stand_ins.values()}
        try:
            out = meta_call(mode, func, args, kwargs)
        except NotImplementedError:
            return DECLINED

        def wrap(t: Any) -> Any:
            if isinstance(t, FakeTensor):  # a written input
                return t
            if type(t) is torch.Tensor:
                if stand_ins is not None and id(t) in ids:
                    raise NotOnMeta
                return self._make_fake(t, cpu)
            return t

        try:
            return wrap(out) if type(out) is torch.Tensor else map_leaves(wrap, out)
        except NotOnMeta:
            return DECLINED

    def _large_on_meta(self, func, args, kwargs):  # noqa: ANN001
        """``func`` of real CPU tensors as a fake tensor, if it makes a new floating tensor or an
        integer one too large to be made real (:meth:`_small_int`); None if not: its meta kernel on
        meta copies of the inputs (no data), the result wrapped as fake. Cheaper than the fake
        mode's own path, which converts each real input on every call."""
        if func._schema.is_mutable or func.is_view:
            return None
        to_meta = lambda x: (torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")  # noqa: E731
                             if isinstance(x, torch.Tensor) else x)
        try:
            meta_args, meta_kwargs = map_leaves(to_meta, (args, kwargs))
            meta_out = func(*meta_args, **meta_kwargs)
        except (NotImplementedError, RuntimeError):
            return None  # no meta kernel: computed for real
        outs = [t for t in leaves_of(meta_out) if isinstance(t, torch.Tensor)]
        if not outs or all(t.dtype in _REAL_DTYPES and t.numel() <= REAL_INT_NUMEL for t in outs):
            return None
        cpu = torch.device("cpu")
        return map_leaves(lambda t: self._make_fake(t, cpu) if isinstance(t, torch.Tensor) else t, meta_out)

    @staticmethod
    def _small_int(t: Any) -> bool:
        return (
            isinstance(t, torch.Tensor)
            and t.dtype in _REAL_DTYPES
            and t.numel() <= REAL_INT_NUMEL
            and t.device.type == "cpu"
        )

    def _realize_factory(self, func, args, kwargs, t):  # noqa: ANN001
        # Scalars made from nothing are made for real too (a logged metric's accumulator).
        scalar = isinstance(t, torch.Tensor) and t.dim() == 0 and t.device.type == "cpu"
        if not (self._small_int(t) or scalar):
            return t
        real = func(*args, **kwargs)
        return real if isinstance(real, torch.Tensor) else t

    def _realize(self, t: Any, fill: int) -> Any:
        if not self._small_int(t):
            return t
        value = False if t.dtype == torch.bool else fill
        return torch.full(tuple(t.shape), value, dtype=t.dtype)
