"""Floating-point dtypes named in YAML: one table of spellings for every key that takes one.

A model's ``dtype``, quantization's ``compute_dtype``, the FSDP2 strategy's ``param_dtype`` and
``reduce_dtype``, the rollout engine's ``dtype``... all go through :func:`resolve_dtype`, so they
accept the same names and fail with the same message naming the key.
"""

from __future__ import annotations

import torch

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
