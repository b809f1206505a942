"""Liger's fused Triton kernels (``liger-kernel``) on a Hugging Face model: RMSNorm, SwiGLU, RoPE.

Liger patches a loaded model in place (``_apply_liger_kernel_to_instance``): each RMSNorm and MLP
module of the instance gets Liger's forward, and RoPE's ``apply_rotary_pos_emb`` is replaced in the
model's ``modeling_*`` module (for every model of that type in the process). Parameters, names and
state-dict keys are unchanged, so checkpoints, FSDP2 sharding and export are unaffected.

What it saves for backward: Liger's SwiGLU keeps its two inputs (eager's ``silu(gate) * up`` keeps
three ``[tokens, intermediate]`` tensors), its RMSNorm keeps the input and one scalar per row.

Liger's fused linear cross-entropy is **not** applied: it replaces the model's ``forward`` when
called with ``labels``, and the recipes never call that forward for their loss -- they score
tokens through :func:`lightning_mem.logits.score_tokens`, which already projects only the scored
positions, in chunks, and computes log-probs and entropy (which RL needs and Liger's loss does
not return). Its plain cross-entropy kernel is not applied for the same reason.

Liger also rebinds names in the model type's ``modeling_*`` module (``apply_rotary_pos_emb``, the
RMSNorm and MLP classes), and those reach every model of that type built or run later in the
process. :func:`record_module_patches` notes what a call rebound, and :func:`undo_module_patches`
puts it back (``LigerKernels`` does when fit ends), so a later model in the same process (a bare
loop in a benchmark, a second fit, a notebook) is built and run with its own modules again.

Liger's kernels are Triton, and Triton needs a CUDA device: :func:`check_liger` refuses anything
else before a model loads.
"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType
from typing import Any, Callable

from torch import nn


#: The kernels this module applies, as keyword arguments of Liger's ``apply_liger_kernel_to_*``.
KERNELS = ("rms_norm", "swiglu", "rope")


def check_liger(device_type: str) -> None:
    """Refuse Liger where it cannot run: a device other than CUDA, or liger-kernel/triton missing.

    Raises:
        ValueError: what is missing, in words.
    """
    if device_type != "cuda":
        raise ValueError(f"Liger's kernels are Triton kernels and need a CUDA device; this run's device is {device_type}")
    missing = [name for name in ("triton", "liger_kernel") if importlib.util.find_spec(name) is None]
    if missing:
        raise ValueError(f"needs {' and '.join(missing)}: pip install 'lightning-mem[gpu]'"
                         " (liger-kernel; triton comes with torch's CUDA wheels)")


def supported_model_types() -> set[str]:
    """The ``config.model_type`` values Liger knows how to patch (needs liger-kernel and triton)."""
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    return set(MODEL_TYPE_TO_APPLY_LIGER_FN)


def apply_liger_kernels(model: nn.Module, **kernels: bool) -> dict[str, bool]:
    """Patch ``model`` (a ``PreTrainedModel``) with Liger's kernels; ``kernels`` picks among
    :data:`KERNELS` (all by default). Returns the kernels asked for and whether each is on.

    Raises:
        ValueError: a kernel name not in :data:`KERNELS`, or a model type Liger does not know
            (Liger itself would only log that and change nothing).
    """
    chosen = liger_settings(**kernels)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in supported_model_types():
        raise ValueError(f"Liger has no kernels for model type {model_type!r} ({type(model).__name__})")
    from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance

    # The loss kernels stay off: the recipes' loss is lightning_mem.logits (see the module).
    _apply_liger_kernel_to_instance(model=model, cross_entropy=False, fused_linear_cross_entropy=False, **chosen)
    return chosen


def liger_settings(**kernels: Any) -> dict[str, bool]:
    """``kernels`` as booleans, every kernel named (a typo is an error, not a silent default)."""
    unknown = sorted(set(kernels) - set(KERNELS))
    if unknown:
        raise ValueError(f"unknown Liger kernels {unknown}; known: {list(KERNELS)}")
    return {name: bool(kernels.get(name, True)) for name in KERNELS}


#: One rebound name: the module, the name and its value before.
ModulePatch = tuple[ModuleType, str, Any]


def record_module_patches(call: Callable[[], Any], prefix: str = "transformers.") -> tuple[Any, list[ModulePatch]]:
    """Run ``call()`` and return its result with every module-level name it rebound in the already
    imported modules under ``prefix``, and the value each had (what :func:`undo_module_patches` puts
    back). Names it added are left: a lazy package gains its submodules as attributes on import."""
    modules = [module for name, module in list(sys.modules.items()) if name.startswith(prefix) and module is not None]
    before = [(module, dict(vars(module))) for module in modules]
    result = call()
    patches = [(module, name, old) for module, names in before for name, old in names.items()
               if vars(module).get(name, old) is not old]
    return result, patches


def undo_module_patches(patches: list[ModulePatch]) -> int:
    """Put back what :func:`record_module_patches` recorded, newest first; returns how many names."""
    for module, name, value in reversed(patches):
        setattr(module, name, value)
    return len(patches)
