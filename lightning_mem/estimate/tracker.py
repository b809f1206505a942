"""Count the bytes of live tensors, by category, while real code runs on real or fake tensors.

:class:`MemoryLedger` holds one entry per tensor storage (views share it, so they count once):
its bytes and its category. Categories are assigned when a storage is made (the section of code
that is running says ``kv_cache``, ``optimizer_state`` or ``host``; a floating tensor whose last
dimension is a vocabulary size is ``logits``; other floating tensors are ``activations``; integer
and boolean tensors -- token ids, masks, indices -- are ``other``) and re-assigned when the
estimator learns more (parameters become ``weights``, ``p.grad`` becomes ``gradients``). A
``DTensor`` counts as its local shard: the bytes this rank holds. The ledger keeps the running
total of device bytes, its peak, and the breakdown at that peak (or, with a per-rank ``view``,
the peak of what one rank holds).

:class:`TrackingMode` is the ``TorchDispatchMode`` that feeds the ledger with every tensor an
operator returns. With ``fake=True`` it also makes the step run without memory: floating tensors
(weights, activations, logits, caches) are ``FakeTensor``\\ s -- shapes and dtypes only -- while
small integer and boolean tensors (token ids, masks, lengths) and scalars made from nothing stay real, so the Python control flow
of ``generate``, micro-batching and masking runs as it does for real. An integer result of a fake
computation (``argmax``/``multinomial`` of fake logits) is made real with a fixed value: the
``fill_token`` for sampled tokens (the estimator picks one that is not an end-of-sequence token,
so every response is as long as the config allows -- the worst case), 0 or ``False`` otherwise.
A Python scalar read from a fake tensor (``loss.item()``) is 0.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import SUPPORTED_NODES, tree_flatten, tree_map

from lightning_mem.offload import local_tensor

CATEGORIES = ("weights", "gradients", "optimizer_state", "activations", "logits", "kv_cache", "other")
HOST = "host"
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


_DEVICE_QUERY = torch.ops.prim.device.default
# Not a view in its schema (autograd treats its output as new), but its kernel returns a view of its
# input: the fake mode decomposes it into ``view`` (two passes through its cache for one view).
_UNSAFE_VIEW = torch.ops.aten._unsafe_view.default
# In-place operators whose meta kernel changes more than values (sizes, strides, storage).
_NOT_IN_PLACE_ON_META = {torch.ops.aten.set_, torch.ops.aten.resize_, torch.ops.aten.resize_as_}
_CPU = torch.device("cpu")
# Operators whose fake-mode rule differs from their meta kernel only across devices (it runs the
# kernel and returns the written input, or a new tensor on the input's device).
_SAME_DEVICE_RULES = {torch.ops.aten.copy_.default}
_DECLINED = object()


class _NotOnMeta(Exception):
    """An output the meta path cannot stand for (:meth:`TrackingMode._on_meta`)."""


def _is_fake(x: Any) -> bool:
    return isinstance(x, FakeTensor)


# An operator's arguments and outputs are tensors and scalars in plain tuples, lists and dicts. torch's
# pytree walks them through its node registry, a few microseconds a node, on every operator the
# estimate runs (about a tenth of its time); these walk exact tuples, lists and dicts directly, in
# pytree's order, and hand anything else that pytree treats as a node (a namedtuple, torch.Size,
# an OrderedDict, any registered type) to pytree itself.
_PYTREE_NODES = (tuple, list, dict, deque)


def _pytree_node(tree: Any) -> bool:
    return isinstance(tree, _PYTREE_NODES) or type(tree) in SUPPORTED_NODES


def _gather_leaves(tree: Any, out: list[Any]) -> bool:
    kind = type(tree)
    if kind is dict:
        tree = tree.values()
    elif kind is not tuple and kind is not list:
        if _pytree_node(tree):  # a node of pytree's own kind: ask it
            return False
        out.append(tree)
        return True
    for x in tree:  # a loop, not all(generator): this runs twice for each of 100k-800k operators
        kind = type(x)
        if kind is tuple or kind is list or kind is dict:
            if not _gather_leaves(x, out):
                return False
        elif kind is FakeTensor or kind is int or kind is float or kind is bool or x is None:
            out.append(x)
        elif _pytree_node(x):
            return False
        else:
            out.append(x)
    return True


def leaves_of(tree: Any) -> list[Any]:
    """``tree_flatten(tree)[0]``, faster for plain tuples, lists and dicts."""
    out: list[Any] = []
    return out if _gather_leaves(tree, out) else tree_flatten(tree)[0]


def map_leaves(fn: Callable[[Any], Any], tree: Any) -> Any:
    """``tree_map(fn, tree)``, faster for plain tuples, lists and dicts."""
    kind = type(tree)
    if kind is tuple:
        return tuple(map_leaves(fn, x) for x in tree)
    if kind is list:
        return [map_leaves(fn, x) for x in tree]
    if kind is dict:
        return {k: map_leaves(fn, v) for k, v in tree.items()}
    if _pytree_node(tree):
        return tree_map(fn, tree)
    return fn(tree)


def _key_of(tree: Any) -> Any:
    """A hashable key of an operator's arguments: the nesting kept, a fake tensor by its layout, a
    plain real tensor by its layout too (only the meta path, which reads no values, keys on one)."""
    kind = type(tree)
    if kind is tuple or kind is list:
        return (kind, *[_fake_key(x) if type(x) is FakeTensor else _key_of(x) for x in tree])
    if kind is FakeTensor or isinstance(tree, FakeTensor):  # the fake mode's results do not depend on the class
        return _fake_key(tree)
    if kind is dict:
        return (dict, *((k, _key_of(v)) for k, v in tree.items()))
    if kind is torch.Tensor or kind is nn.Parameter:
        return (kind, tuple(tree.shape), tree.stride(), tree.dtype, tree.device, tree.storage_offset(),
                tree.requires_grad)
    if isinstance(tree, torch.Tensor):
        raise TypeError("a tensor subclass")
    hash(tree)
    return (kind, tree)


def _fake_key(t: FakeTensor) -> tuple[Any, ...]:
    return (FakeTensor, tuple(t.shape), t.stride(), t.dtype, t.fake_device, t.storage_offset(), t.requires_grad)


def _place_of(t: torch.Tensor) -> tuple[Any, ...]:
    """A tensor's layout and the size of its storage: what an in-place operator must not change for
    the run's cache to stand for it."""
    return tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.untyped_storage().nbytes()


def _layout_of(out: Any, inputs: list[torch.Tensor]) -> Any:
    """``out`` with each tensor replaced by its layout, or None if one shares storage with an input
    or another output, or starts at an offset (those the cache leaves to the fake mode)."""
    kind = type(out)
    seen = {id(x.untyped_storage()) for x in inputs}
    if kind is FakeTensor:
        outs = [out]
    elif kind is tuple or kind is list:
        if not all(type(x) is FakeTensor or x is None or type(x) in (int, float, bool) for x in out):
            return None
        outs = [x for x in out if type(x) is FakeTensor]
    else:
        return None
    for t in outs:
        storage = id(t.untyped_storage())
        if storage in seen or t.storage_offset() != 0:
            return None
        seen.add(storage)
    layout = lambda t: ((tuple(t.shape), t.stride(), t.dtype, t.fake_device, t.requires_grad)  # noqa: E731
                        if type(t) is FakeTensor else t)
    return layout(out) if kind is FakeTensor else (kind, [layout(x) for x in out])


class _FakeMaker:
    """Wraps a meta tensor as a ``FakeTensor`` of one fake mode, as ``FakeTensor(mode, meta, device)``
    does, at a fraction of its cost.

    The constructor checks its arguments, normalizes the device and sets about twenty attributes one by
    one, half of them through descriptors (its memo slots): about 50 us, paid for each of the tens of
    thousands of views and results an estimate makes. Here the tensor is made by the same
    ``Tensor._make_subclass`` call, and its attributes are copied in one go from a tensor the
    constructor made for that device (``tests/estimate/test_tracker_real_inputs.py`` holds the two
    equal). ``device`` must be a fake tensor's ``fake_device`` (already normalized) or the CPU.
    """

    def __init__(self, mode: FakeTensorMode) -> None:
        self.mode = mode
        self._state: dict[torch.device, dict[str, Any]] = {}
        self._guard = (torch._C._set_warn_deprecated_on_mutable_data_ptr if mode._allow_unsafe_data_ptr_access
                       else torch._C._set_throw_on_mutable_data_ptr)

    def __call__(self, meta: torch.Tensor, device: torch.device) -> FakeTensor:
        state = self._state.get(device)
        if state is None:
            state = self._state[device] = dict(FakeTensor(self.mode, torch.empty(0, device="meta"), device).__dict__)
        t = torch.Tensor._make_subclass(FakeTensor, meta, meta.requires_grad, dispatch_device=True,
                                        device_for_backend_keys=device)
        self._guard(t)
        t.__dict__.update(state)
        return t


def _fake_mode_runs_meta(mode: FakeTensorMode, func: Any) -> bool:
    """Whether the fake mode's result of ``func`` on fake (and real CPU) tensors of one device is what
    ``func``'s meta kernel returns, wrapped as fake: an aten operator with a meta kernel that the
    fake mode neither decomposes (it does when neither a Python nor a C++ symbolic meta kernel is
    registered), nor hands to a rule of its own (constructors, ``copy_``, ``index_put_``, ``nonzero``
    and the other operators whose results depend on data or mix devices), nor answers directly (size
    queries, ``lift_fresh``); and that changes no size, stride or storage in place."""
    from torch._decomp import meta_table
    from torch._library.simple_registry import singleton
    from torch._subclasses.fake_impls import op_implementations_checks
    from torch._subclasses.fake_tensor import _DISPATCH_HANDLE_DIRECTLY, _DISPATCH_META_HANDLERS

    tags = func.tags
    return (
        func.namespace == "aten"
        and func.overloadpacket not in _NOT_IN_PLACE_ON_META
        and torch.Tag.inplace_view not in tags
        and torch.Tag.dynamic_output_shape not in tags
        and torch.Tag.data_dependent_output not in tags
        and func not in mode.lift_fns
        and func not in _DISPATCH_META_HANDLERS
        and func not in _DISPATCH_HANDLE_DIRECTLY
        # An in-place operator returns its written inputs however the fake mode runs it.
        and (_returns_written(func) or not _decomposed_by(mode, func, meta_table))
        and torch._C._dispatch_has_computed_kernel_for_dispatch_key(func.name(), "Meta")
        and (func in _SAME_DEVICE_RULES or not any(check(func) for check, _ in op_implementations_checks))
        and not singleton.find(func.name()).fake_impl.kernel
    )


def _returns_written(func: Any) -> bool:
    """An in-place operator that returns only inputs it writes, or nothing."""
    schema = func._schema
    return schema.is_mutable and all(r.alias_info is not None and r.alias_info.is_write for r in schema.returns)


def _written(func: Any, args: Any, kwargs: Any) -> list[Any]:
    """The tensors an in-place operator writes: its arguments marked as written in its schema."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
        out.extend(x for x in leaves_of(value) if isinstance(x, torch.Tensor))
    return out


def _decomposed_by(mode: FakeTensorMode, func: Any, meta_table: Any) -> bool:
    """Whether the fake mode runs ``func`` as a decomposition into other operators (its
    ``_dispatch_impl``, without symbolic sizes) rather than by its meta kernel."""
    from torch._decomp import decomposition_table
    from torch._subclasses.fake_tensor import torch_decomp_decompositions

    if func in meta_table or mode.cpp_meta_supports_symint(func):
        return False
    if func in decomposition_table and torch_decomp_decompositions(func):
        return True
    dk = torch._C.DispatchKey.CompositeImplicitAutograd
    return dk in func.py_kernels or torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), dk)


def _meta_call(mode: FakeTensorMode, func: Any, args: Any, kwargs: Any) -> Any:
    """``func`` run by its meta kernel on fake tensors' own meta storage: what
    ``in_kernel_invocation_manager(mode)`` does around a call, without a generator's context manager
    (a fifth of a view's cost)."""
    prev = mode.in_kernel_invocation
    with torch._C._DisableTorchDispatch(), torch._C._PreserveDispatchKeyGuard():
        mode.in_kernel_invocation = True
        torch._C._set_meta_in_tls_dispatch_include(True)
        try:
            return func(*args, **kwargs)
        finally:
            mode.in_kernel_invocation = prev


class _Written:
    """A cache entry of an in-place operator: its outputs are these of its inputs (their places
    among the argument leaves; ``kind`` a tuple or list of them, or None for one)."""

    __slots__ = ("places", "kind")

    def __init__(self, places: list[int], kind: type | None) -> None:
        self.places, self.kind = places, kind

    @staticmethod
    def of(out: Any, leaves: list[Any]) -> _Written | None:
        """The entry for ``out`` if each of its tensors is one of ``leaves`` (None otherwise)."""
        outs, kind = ([out], None) if type(out) is not tuple and type(out) is not list else (list(out), type(out))
        if out is None:
            outs = []
        places = []
        for t in outs:
            place = next((i for i, x in enumerate(leaves) if x is t), None)
            if place is None:
                return None
            places.append(place)
        return _Written(places, kind) if out is not None else _Written([], type(None))

    def outputs(self, leaves: list[Any]) -> Any:
        if self.kind is type(None):
            return None
        outs = [leaves[i] for i in self.places]
        return outs[0] if self.kind is None else self.kind(outs)


def _rebuild(make_fake: _FakeMaker, entry: Any) -> Any:
    def make(layout: Any) -> Any:
        if type(layout) is not tuple:
            return layout
        shape, stride, dtype, device, requires_grad = layout
        meta = torch.empty_strided(shape, stride, dtype=dtype, device="meta", requires_grad=requires_grad)
        return make_fake(meta, device)

    if type(entry[0]) is type:  # (tuple or list, layouts)
        kind, layouts = entry
        return kind(make(x) for x in layouts)
    return make(entry)


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
            self._make_fake = _FakeMaker(self.fake_mode)
        #: This run's cache of fake results (:meth:`_fake_dispatch`): operator and argument layouts
        #: to output layouts.
        self._op_cache: dict[Any, Any] = {}
        #: Per operator: whether its meta kernel gives the fake mode's result (:func:`_fake_mode_runs_meta`).
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
        if (func.is_view or func is _UNSAFE_VIEW) and tensors and all(
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
        if tensors and not has_fake:  # all inputs real: compute for real, unless large and floating
            if max(x.numel() for x in tensors) > REAL_FLOAT_INPUT_NUMEL:
                fake_out = self._floating_on_meta(func, args, kwargs)
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
            runs_meta = self._runs_meta[func] = _fake_mode_runs_meta(mode, func)
        # Fake tensors of this mode (the fake Params4bit too: a subclass) and plain real tensors: their
        # layouts decide the result wherever the fake mode caches it, or the meta path runs it.
        keyable = all(
            (x.fake_mode is mode and x.constant is None) if isinstance(x, FakeTensor)
            else (type(x) is torch.Tensor or type(x) is nn.Parameter)
            for x in tensors
        )
        mutable = func._schema.is_mutable
        key = None
        if keyable and (runs_meta or not mutable or _returns_written(func)):
            try:
                # The global state the fake mode's own key holds that can change an output's layout.
                key = (func, torch.get_default_dtype(), torch.is_inference_mode_enabled(), _key_of(args),
                       _key_of(kwargs))
                entry = self._op_cache.get(key)
            except TypeError:  # an unhashable argument
                key, entry = None, None
            if entry is not None:
                return entry.outputs(leaves) if type(entry) is _Written else _rebuild(self._make_fake, entry)
        if runs_meta:
            out = self._on_meta(func, args, kwargs, tensors)
            if out is not _DECLINED:
                if key is not None:
                    entry = _Written.of(out, leaves) if mutable else _layout_of(out, tensors)
                    if entry is not None:
                        self._op_cache[key] = entry
                return out
        if key is not None and mutable:  # an in-place operator with a rule of the fake mode's (a fake kernel)
            before = [_place_of(x) for x in tensors]
            out = mode.__torch_dispatch__(func, (), args, kwargs)
            # Its outputs are inputs it wrote, each as itself, and it left every input's layout as it
            # was: another call with the same layouts returns the same inputs.
            entry = _Written.of(out, leaves)
            if entry is not None and before == [_place_of(x) for x in tensors]:
                self._op_cache[key] = entry
            return out
        hits, misses = FakeTensorMode.cache_hits, FakeTensorMode.cache_misses
        out = mode.__torch_dispatch__(func, (), args, kwargs)
        if key is not None and FakeTensorMode.cache_hits + FakeTensorMode.cache_misses == hits + misses + 1:
            entry = _layout_of(out, tensors)
            if entry is not None:
                self._op_cache[key] = entry
        return out

    def _view_on_meta(self, func, args, kwargs, device):  # noqa: ANN001
        """A view of fake tensors, as the fake mode makes it but without its operator cache: the
        view's meta kernel on the fake tensors' own meta storage, wrapped as fake. A view allocates
        nothing; its key in the cache cost three times the kernel (views are a third of the
        operators a step dispatches)."""
        out = _meta_call(self.fake_mode, func, args, kwargs)
        if type(out) is torch.Tensor:  # most views: one tensor
            return self._make_fake(out, device)
        return map_leaves(lambda t: self._make_fake(t, device) if isinstance(t, torch.Tensor) else t, out)

    def _on_meta(self, func, args, kwargs, tensors):  # noqa: ANN001
        """``func`` of this mode's fake tensors and real tensors, all on the CPU, by its meta kernel
        (:func:`_fake_mode_runs_meta`), as the fake mode would run it: each real input as an empty
        meta tensor of its layout, each new output wrapped as a fake CPU tensor, a written input
        returned as itself. ``_DECLINED`` where the fake mode must decide (another device, a tensor
        subclass, a written real tensor, an output that is a real input's stand-in). The fake mode's own path
        costs 100-1,000 us an operator in checks, cache keys and conversions of real inputs; this
        one 10-20 us."""
        mode, cpu = self.fake_mode, _CPU
        stand_ins = None
        for x in tensors:
            if isinstance(x, FakeTensor):
                if x.fake_mode is not mode or x.constant is not None or x.fake_device != cpu:
                    return _DECLINED
            elif (type(x) is torch.Tensor or type(x) is nn.Parameter) and x.device == cpu:
                stand_ins = stand_ins or {}
                stand_ins[id(x)] = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
            else:
                return _DECLINED
        if stand_ins is not None:
            if func._schema.is_mutable and any(id(x) in stand_ins for x in _written(func, args, kwargs)):
                return _DECLINED  # a real tensor written: the fake mode's rule (it keeps its values)
            meta = lambda x: stand_ins.get(id(x), x) if isinstance(x, torch.Tensor) else x  # noqa: E731
            args, kwargs = map_leaves(meta, (args, kwargs))
            ids = {id(v) for v in stand_ins.values()}
        try:
            out = _meta_call(mode, func, args, kwargs)
        except NotImplementedError:
            return _DECLINED

        def wrap(t: Any) -> Any:
            if isinstance(t, FakeTensor):  # a written input
                return t
            if type(t) is torch.Tensor:
                if stand_ins is not None and id(t) in ids:
                    raise _NotOnMeta
                return self._make_fake(t, cpu)
            return t

        try:
            return wrap(out) if type(out) is torch.Tensor else map_leaves(wrap, out)
        except _NotOnMeta:
            return _DECLINED

    def _floating_on_meta(self, func, args, kwargs):  # noqa: ANN001
        """``func`` of real CPU tensors as a fake tensor, if it makes a new floating tensor (None if
        not): its meta kernel on meta copies of the inputs (no data), the result wrapped as fake.
        Cheaper than the fake mode's own path, which converts each real input on every call."""
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
        if not outs or all(t.dtype in _REAL_DTYPES for t in outs):
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
