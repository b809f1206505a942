"""Floating-point dtypes: one table of spellings for every key that takes one, and one rule for
the dtype each model role loads in under the trainer's precision.

A model's ``dtype``, quantization's ``compute_dtype``, the FSDP2 strategy's ``param_dtype`` and
``reduce_dtype``, the rollout engine's ``dtype``... all go through :func:`resolve_dtype`, so they
accept the same names and fail with the same message naming the key.

:meth:`PrecisionDtypes.load_dtype` is the rule every recipe applies to every model it loads:

========================  ===============================  ===================================
trainer precision         trained (full model, adapters,   frozen (reference, reward model,
                          critic, value head)              LoRA/QLoRA base), dtype unset
========================  ===============================  ===================================
``32-true``               float32                          float32
``bf16-mixed``            float32 (master weights)         bfloat16 (the compute dtype)
``16-mixed``              float32 (master weights)         float16
``bf16-true``             bfloat16                         bfloat16
``16-true``               float16                          float16
========================  ===============================  ===================================

whatever the checkpoint's ``torch_dtype``. An explicit dtype for trained parameters must agree
with the precision; a frozen model's explicit dtype is kept, except under ``*-true`` (whose plugin
casts every parameter).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from lightning_mem.settings import SettingError

#: Accepted names (case-insensitive, with or without a ``torch.`` prefix).
DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_dtype(value: str | torch.dtype | None, *, key: str = "dtype") -> torch.dtype | None:
    """A floating ``torch.dtype`` from a name (``"bf16"``, ``"torch.float16"``) or a dtype.

    ``None`` and ``"auto"`` give ``None``: keep what the checkpoint or the parameters have.

    Raises:
        SettingError: naming ``key`` (a ValueError) when the value names no floating-point dtype.
    """
    if value is None:
        return None
    if isinstance(value, torch.dtype) and value.is_floating_point:
        return value
    if isinstance(value, str):
        name = value.strip().lower().removeprefix("torch.")
        if name == "auto":
            return None
        if name in DTYPE_NAMES:
            return DTYPE_NAMES[name]
    raise SettingError(
        key,
        f": unknown dtype {value!r} ({key}={value!r} is not a floating-point dtype); use one of "
        f"{sorted(DTYPE_NAMES)}, a torch.dtype, or 'auto'/null to keep the checkpoint's own",
    )


# ---------------------------------------------------------------------------------------------
# Which dtype each model role loads in, under the trainer's precision
# ---------------------------------------------------------------------------------------------
# transformers 5.x loads a model in its config's `torch_dtype` (bfloat16 for every real
# checkpoint) unless told otherwise, and Lightning's `32-true` and `*-mixed` never cast the module:
# without this rule "fp32 master weights, bf16 compute" silently trains bf16 weights, and bf16's
# 8-bit mantissa rounds away any update below ~0.4 % of a weight.

#: Lightning's precision names -> (dtype of trained parameters, dtype the matmuls run in).
_PRECISION_DTYPES: dict[str, tuple[torch.dtype, torch.dtype]] = {
    "32-true": (torch.float32, torch.float32),
    "bf16-mixed": (torch.float32, torch.bfloat16),
    "16-mixed": (torch.float32, torch.float16),
    "bf16-true": (torch.bfloat16, torch.bfloat16),
    "16-true": (torch.float16, torch.float16),
    "64-true": (torch.float64, torch.float64),
}
#: The spellings Lightning's Trainer accepts for the same precisions.
_PRECISION_ALIASES = {"32": "32-true", "64": "64-true", "16": "16-mixed", "bf16": "bf16-mixed"}
#: Precisions whose plugin casts the whole module to one dtype during setup (Lightning's
#: HalfPrecision and DoublePrecision): no model of any role can keep another dtype under them.
_CASTING_PRECISIONS = ("bf16-true", "16-true", "64-true")
#: What to write instead, for a trained dtype the precision contradicts.
_PRECISION_FOR = {torch.bfloat16: "bf16-true", torch.float16: "16-true", torch.float32: "32-true or bf16-mixed",
                  torch.float64: "64-true"}

Role = Literal["trained", "frozen"]


def dtype_name(dtype: torch.dtype | str) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def _is_auto(value: object) -> bool:
    return isinstance(value, str) and value.strip().lower() == "auto"


@dataclass(frozen=True)
class PrecisionDtypes:
    """What a Lightning precision means for the parameters of each model role.

    Attributes:
        precision: the precision's canonical name (``"bf16-mixed"``).
        trained: dtype of trained parameters (and so of their gradients and of AdamW's moments):
            float32 under ``32-true`` and ``*-mixed`` -- the master weights that keep small updates
            -- whatever the checkpoint's ``torch_dtype``; the 16-bit dtype under ``*-true``.
        compute: dtype the matmuls run in (autocast's under ``*-mixed``). Frozen models load in it
            by default: they take no update, so a wider copy would only cost memory.
    """

    precision: str
    trained: torch.dtype
    compute: torch.dtype

    @property
    def casts_module(self) -> bool:
        """True when the precision's plugin casts every parameter of the module to one dtype."""
        return self.precision in _CASTING_PRECISIONS

    def load_dtype(
        self, value: str | torch.dtype | None, *, role: Role, key: str = "dtype", precision_key: str = "precision"
    ) -> torch.dtype | Literal["auto"]:
        """The dtype a model of ``role`` loads in, given its own dtype setting ``value`` (None: unset).

        - ``trained``: :attr:`trained`. A ``value`` that names another dtype is an error: under
          ``*-mixed`` it would drop the fp32 master weights the precision promises, under ``*-true``
          the plugin would cast it back anyway. ``auto`` (the checkpoint's) is an error too.
        - ``frozen`` (a reference or reward model, a LoRA/QLoRA base): unset, :attr:`compute`;
          otherwise ``value`` as given (``"auto"``: the checkpoint's own) -- except under a precision
          that casts the whole module, where only its dtype can hold.

        Raises:
            SettingError: naming ``key`` and ``precision_key``, before anything loads.
        """
        if role not in ("trained", "frozen"):
            raise ValueError(f"role must be 'trained' or 'frozen', got {role!r}")
        explicit = resolve_dtype(value, key=key)
        auto = explicit is None and _is_auto(value)
        must_be = self.trained if role == "trained" or self.casts_module else None
        if must_be is None:  # a frozen model under 32-true or *-mixed
            return "auto" if auto else (explicit or self.compute)
        if auto:
            raise SettingError(
                key, f"`{key}: auto` asks for the checkpoint's dtype, but under `{precision_key}: {self.precision}` "
                f"{'trained parameters are' if role == 'trained' else 'every parameter is'} {dtype_name(must_be)}; "
                f"leave `{key}` unset",
            )
        if explicit is None or explicit == must_be:
            return must_be
        if role == "trained":
            why = (f"which keeps trained parameters, their gradients and optimizer state in {dtype_name(must_be)}"
                   + (f" (fp32 master weights, {dtype_name(self.compute)} compute)" if self.compute != must_be else ""))
            fix = f"train in {dtype_name(explicit)} with `{precision_key}: {_PRECISION_FOR.get(explicit, '...')}`"
        else:
            why = f"which casts every parameter to {dtype_name(must_be)}"
            fix = f"use a precision that keeps other dtypes (`{precision_key}: 32-true` or `bf16-mixed`)"
        raise SettingError(
            key, f"`{key}: {dtype_name(explicit)}` contradicts `{precision_key}: {self.precision}`, {why}. "
            f"Leave `{key}` unset to follow the precision, or {fix}",
        )


def precision_dtypes(precision: str | int, *, key: str = "precision") -> PrecisionDtypes:
    """The dtypes of a Lightning precision (``"32-true"``, ``"bf16-mixed"``, ``"bf16-true"``, ...).

    Raises:
        SettingError: naming ``key`` for a precision with no rule here (``transformer-engine``).
    """
    name = _PRECISION_ALIASES.get(str(precision), str(precision))
    if name not in _PRECISION_DTYPES:
        raise SettingError(key, f": {precision!r} has no rule for parameter dtypes; use one of {sorted(_PRECISION_DTYPES)}")
    return PrecisionDtypes(name, *_PRECISION_DTYPES[name])


def trainer_dtypes(trainer: Any | None, *, key: str = "precision") -> PrecisionDtypes:
    """:func:`precision_dtypes` of ``trainer.precision``; ``None`` (a module used outside a
    Trainer) gives Lightning's default, ``32-true``."""
    return precision_dtypes("32-true" if trainer is None else trainer.precision, key=key)


def cast_trainable(module: nn.Module, dtype: torch.dtype) -> int:
    """Cast every trainable floating-point parameter of ``module`` to ``dtype``; returns how many changed.

    For adapters added to a 16-bit base: peft upcasts LoRA's A and B to fp32 by default, but not a
    trained copy (``modules_to_save``) or a bias trained with ``bias: all``, and not to a 16-bit
    dtype under ``*-true``. One dtype for everything that trains is also what FSDP2 needs: it
    refuses a unit whose trainable parameters differ in dtype.
    """
    changed = 0
    for param in module.parameters():
        if param.requires_grad and param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
            changed += 1
    return changed
