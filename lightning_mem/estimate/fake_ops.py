"""How the tracker runs an operator on fake tensors at a fraction of the fake mode's own cost.

The fake mode (``FakeTensorMode``) checks every argument, keys its cache on their whole metadata
and converts every real input on every call: 100-1,000 us an operator, over the 100k-800k
operators an estimate dispatches. :class:`~lightning_mem.estimate.tracker.TrackingMode` uses these
pieces to reach the same results more cheaply: a walk of an operator's arguments (:func:`leaves_of`),
a key of their layouts (:func:`key_of`) for the run's own cache of results (:func:`layout_of`,
:func:`rebuild`, :class:`Written`), the rules for when an operator's meta kernel is what the fake
mode would run (:func:`fake_mode_runs_meta`, :func:`meta_call`), and a cheap maker of fake tensors
(:class:`FakeMaker`). ``tests/estimate/test_tracker_real_inputs.py`` holds each to the fake mode.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._pytree import SUPPORTED_NODES, tree_flatten, tree_map

# Not a view in its schema (autograd treats its output as new), but its kernel returns a view of its
# input: the fake mode decomposes it into ``view`` (two passes through its cache for one view).
UNSAFE_VIEW = torch.ops.aten._unsafe_view.default
# In-place operators whose meta kernel changes more than values (sizes, strides, storage).
_NOT_IN_PLACE_ON_META = {torch.ops.aten.set_, torch.ops.aten.resize_, torch.ops.aten.resize_as_}
CPU = torch.device("cpu")
# Operators whose fake-mode rule differs from their meta kernel only across devices (it runs the
# kernel and returns the written input, or a new tensor on the input's device).
_SAME_DEVICE_RULES = {torch.ops.aten.copy_.default}
DECLINED = object()


class NotOnMeta(Exception):
    """An output the meta path cannot stand for (:meth:`~lightning_mem.estimate.tracker.TrackingMode._on_meta`)."""


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


def key_of(tree: Any) -> Any:
    """A hashable key of an operator's arguments: the nesting kept, a fake tensor by its layout, a
    plain real tensor by its layout too (only the meta path, which reads no values, keys on one)."""
    kind = type(tree)
    if kind is tuple or kind is list:
        return (kind, *[fake_key(x) if type(x) is FakeTensor else key_of(x) for x in tree])
    if kind is FakeTensor or isinstance(tree, FakeTensor):  # the fake mode's results do not depend on the class
        return fake_key(tree)
    if kind is dict:
        return (dict, *((k, key_of(v)) for k, v in tree.items()))
    if kind is torch.Tensor or kind is nn.Parameter:
        return (kind, tuple(tree.shape), tree.stride(), tree.dtype, tree.device, tree.storage_offset(),
                tree.requires_grad)
    if isinstance(tree, torch.Tensor):
        raise TypeError("a tensor subclass")
    hash(tree)
    return (kind, tree)


def fake_key(t: FakeTensor) -> tuple[Any, ...]:
    return (FakeTensor, tuple(t.shape), t.stride(), t.dtype, t.fake_device, t.storage_offset(), t.requires_grad)


def place_of(t: torch.Tensor) -> tuple[Any, ...]:
    """A tensor's layout and the size of its storage: what an in-place operator must not change for
    the run's cache to stand for it."""
    return tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.untyped_storage().nbytes()


def layout_of(out: Any, inputs: list[torch.Tensor]) -> Any:
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


class FakeMaker:
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


def fake_mode_runs_meta(mode: FakeTensorMode, func: Any) -> bool:
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
        and (returns_written(func) or not _decomposed_by(mode, func, meta_table))
        and torch._C._dispatch_has_computed_kernel_for_dispatch_key(func.name(), "Meta")
        and (func in _SAME_DEVICE_RULES or not any(check(func) for check, _ in op_implementations_checks))
        and not singleton.find(func.name()).fake_impl.kernel
    )


def returns_written(func: Any) -> bool:
    """An in-place operator that returns only inputs it writes, or nothing."""
    schema = func._schema
    return schema.is_mutable and all(r.alias_info is not None and r.alias_info.is_write for r in schema.returns)


def written(func: Any, args: Any, kwargs: Any) -> list[Any]:
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


def meta_call(mode: FakeTensorMode, func: Any, args: Any, kwargs: Any) -> Any:
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


class Written:
    """A cache entry of an in-place operator: its outputs are these of its inputs (their places
    among the argument leaves; ``kind`` a tuple or list of them, or None for one)."""

    __slots__ = ("places", "kind")

    def __init__(self, places: list[int], kind: type | None) -> None:
        self.places, self.kind = places, kind

    @staticmethod
    def of(out: Any, leaves: list[Any]) -> Written | None:
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
        return Written(places, kind) if out is not None else Written([], type(None))

    def outputs(self, leaves: list[Any]) -> Any:
        if self.kind is type(None):
            return None
        outs = [leaves[i] for i in self.places]
        return outs[0] if self.kind is None else self.kind(outs)


def rebuild(make_fake: FakeMaker, entry: Any) -> Any:
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
