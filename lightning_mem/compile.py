"""Regional compilation: ``torch.compile`` each decoder block's ``forward``, not the whole model.

A model's decoder blocks are one class repeated, so one compiled graph (per input shape family)
serves every block, and compile time is that of one block however deep the model (torchtune's
``compile_model`` and torchtitan compile per block for this reason). Here the block's own
``forward`` is compiled and bound back onto the block; the module's ``__call__`` -- and with it
every hook on the block -- stays eager around it:

- activation checkpointing (:mod:`lightning_mem.activation_checkpointing`) is a pair of forward
  hooks: it wraps the compiled forward and recomputes it in backward, one graph, no graph breaks
  (compiling ``__call__`` instead, as ``nn.Module.compile`` does, traces those hooks and breaks the
  graph at each of them);
- FSDP2's all-gather and reshard hooks run around the compiled forward, so blocks can be compiled
  before or after ``fully_shard`` (torchtitan's order, checkpoint -> compile -> shard, also works);
- saved-tensor hooks (activation offload) see the compiled graph's saved tensors like eager ones.

Only training forwards are compiled: a block called with a KV cache (generation, e.g. PPO's
rollout with Hugging Face ``generate``) runs eager, since the cache grows in place every step.

The compiled function is bound with ``types.MethodType``, so ``copy.deepcopy`` of a model (a PPO
reference copy) rebinds it to the copy instead of sharing the original's parameters.

Under a ``TorchDispatchMode`` -- the memory estimator's tracker, which runs the recipe's fit on fake
tensors -- a compiled block runs its eager forward: Inductor's kernels cannot run on fake tensors,
and the estimate then measures what eager saves for backward. Inductor saves no more than eager
for a decoder block (its partitioner recomputes cheap pointwise ops instead of saving them: on the
tiny Llama 34 MB against 44 MB for a 4 x 128 batch), so the estimate is an upper bound there.
"""

from __future__ import annotations

import functools
import shutil
import types
from collections.abc import Callable, Iterable
from typing import Any, Optional

import torch
from torch import nn

from lightning_mem.module_tree import default_block_classes, outermost
from lightning_mem.settings import SettingError

_MARK = "_lightning_mem_compiled"

#: The ``mode`` values allowed: CUDA-graph modes ("reduce-overhead", "max-autotune") keep static
#: copies of every input in a private memory pool that neither the estimate nor the memory monitor
#: sees, and replay needs fixed shapes that token-budget batches do not have.
MODES = (None, "default", "max-autotune-no-cudagraphs")


def check_compile_settings(backend: str = "inductor", mode: Optional[str] = None, device_type: str = "cpu") -> None:
    """Refuse settings that cannot work here, before any model loads (errors name ``backend``/``mode``).

    Inductor on a CPU generates C++ and needs a compiler on the ``PATH``.
    """
    if mode not in MODES:
        raise SettingError("mode", f"`mode` must be one of {list(MODES)}, got {mode!r}: CUDA-graph modes keep"
                                   " their own memory pool, outside the estimate and the memory monitor")
    if backend not in torch._dynamo.list_backends(exclude_tags=()):
        raise SettingError("backend", f"`backend` {backend!r} is not a torch.compile backend:"
                                      f" one of {torch._dynamo.list_backends()}")
    if backend == "inductor" and device_type == "cpu" and not (shutil.which("g++") or shutil.which("clang++")):
        raise SettingError("backend", "`backend` inductor on a CPU compiles C++: no g++ or clang++ on the PATH"
                                      " (install one, or use `backend: aot_eager`)")


def is_compiled(block: nn.Module) -> bool:
    """Whether :func:`compile_block` compiled ``block``'s forward."""
    return bool(getattr(block, _MARK, False))


#: Why compiled blocks run their eager forward for now (see :func:`hold_eager`): reason -> whether it
#: still holds. Empty: compiled.
_EAGER_HOLDS: dict[str, Callable[[], bool]] = {}


def hold_eager(reason: str, hold: bool = True, *, alive: Optional[Callable[[], bool]] = None) -> None:
    """While any reason is held, every compiled block runs its eager forward; ``hold=False`` lets go.

    For a step-long observer that watches through Python hooks: ``TrainingDtypes`` counts the first
    batch's compute dtypes through a global module forward hook. Traced into a compiled block, such
    a hook becomes part of the graph and its counter a guard, so each block called in that batch
    fails the last one's guard and recompiles, until dynamo's recompile limit (8) sends the block's
    forward to eager for the rest of the run. Eager while it watches, the block compiles once after.

    ``alive``: the hold also ends as soon as this returns False (TrainingDtypes: its hook is still
    registered), so a hook removed by any path cannot leave every block of the process eager.
    """
    if hold:
        _EAGER_HOLDS[reason] = alive or (lambda: True)
    else:
        _EAGER_HOLDS.pop(reason, None)


def _held() -> bool:
    for reason, alive in list(_EAGER_HOLDS.items()):
        if alive():
            return True
        _EAGER_HOLDS.pop(reason, None)
    return False


@functools.lru_cache(maxsize=None)
def _compiled(function: Any, backend: str, mode: Optional[str], fullgraph: bool, dynamic: Optional[bool]) -> Any:
    # One compiled function per block class and settings: every block of the model shares its graphs.
    compiled = torch.compile(function, backend=backend, mode=mode, fullgraph=fullgraph, dynamic=dynamic)

    @functools.wraps(function)
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if torch.utils._python_dispatch._get_current_dispatch_mode() is not None:
            return function(self, *args, **kwargs)  # the estimator's tracker: eager (see the module)
        if kwargs.get("past_key_values") is not None:
            return function(self, *args, **kwargs)  # generation: eager (see compile_blocks)
        if _EAGER_HOLDS and _held():
            return function(self, *args, **kwargs)  # an observer's hooks are on (see hold_eager)
        return compiled(self, *args, **kwargs)

    return forward


def compile_block(block: nn.Module, *, backend: str = "inductor", mode: Optional[str] = None,
                  fullgraph: bool = False, dynamic: Optional[bool] = None) -> bool:
    """Compile ``block``'s forward (lazily: on its first call); False if it already is compiled."""
    if is_compiled(block):
        return False
    function = type(block).forward
    block.forward = types.MethodType(_compiled(function, backend, mode, fullgraph, dynamic), block)
    setattr(block, _MARK, True)
    return True


def compile_blocks(model: nn.Module, block_classes: Iterable[str] | None = None, **settings: Any) -> tuple[int, int]:
    """Compile every decoder block of ``model`` (:func:`compile_block`); returns ``(compiled, blocks)``.

    Raises:
        ValueError: ``model`` has no module of the block classes.
    """
    classes = list(block_classes or default_block_classes(model))
    # By the class or a base class: FSDP2's fully_shard turns a block into a subclass of its own
    # (FSDPLlamaDecoderLayer), and blocks may be compiled after sharding.
    wanted = set(classes)
    blocks = [block for _, block in outermost(model, lambda m: bool(wanted & {c.__name__ for c in type(m).__mro__}))]
    if not blocks:
        raise ValueError(f"`{type(model).__name__}` has no module of class {sorted(classes)} to compile")
    if getattr(getattr(model, "config", None), "use_cache", False):
        # A KV cache (Hugging Face training forwards build one unless told not to) is appended to in
        # place by each block: its graph would specialise on the layer index (a recompile per block)
        # and a checkpointed block's recompute would see the longer cache. Blocks given a cache --
        # generation, which asks for one explicitly -- run eager.
        model.config.use_cache = False
    return sum(compile_block(block, **settings) for block in blocks), len(blocks)
