"""Load a Hugging Face causal LM and its tokenizer: from weights, or from a config alone.

The same code path serves a real checkpoint (a local folder with weights, or a hub id) and the
shipped tiny model (a folder with only config.json and tokenizer files, initialised at random).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

_WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json", "*.pt")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


_CONFIG_ONLY = contextvars.ContextVar("lightning_mem_config_only_models", default=False)


@contextlib.contextmanager
def config_only_models() -> Iterator[None]:
    """Inside this context a config-only model folder is never given weights on disk.

    A run that trains adapters on a config-only base (the shipped tiny model) first writes seeded
    random weights and reads them back (:func:`lightning_mem.lora.saved_base`,
    :func:`lightning_mem.quantization.load_quantized_causal_lm`), so that the adapter names a base
    that exists. The memory estimator runs the same ``configure_model`` on fake tensors, which can
    be neither written nor read: here those steps build the model from its ``config.json`` instead
    (quantizing through bitsandbytes' own ops where the run would quantize while loading), and
    nothing is written anywhere.
    """
    token = _CONFIG_ONLY.set(True)
    try:
        yield
    finally:
        _CONFIG_ONLY.reset(token)


def building_config_only() -> bool:
    """True inside :func:`config_only_models`."""
    return _CONFIG_ONLY.get()


def resolve_dtype(dtype: str | torch.dtype | None, *, key: str = "dtype") -> torch.dtype | None:
    """Map a YAML dtype string ("bfloat16", "bf16", ...) to a torch dtype; None and "auto" pass as None."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return None
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"`{key}`: unknown dtype {dtype!r}; choose one of {sorted(_DTYPES)} or 'auto'") from None


def has_weights(path: str | os.PathLike) -> bool:
    """True when a local model folder holds weight files, not just a config."""
    folder = Path(path)
    return any(any(folder.glob(pattern)) for pattern in _WEIGHT_PATTERNS)


def check_model_source(name_or_path: str, *, key: str = "model.name_or_path") -> str:
    """Validate a model location before anything heavy happens; returns "local" or "hub".

    A string that exists on disk is a local folder and must hold a config.json. A string that does
    not exist is taken for a hub id only when it looks like one (``org/name``); anything else
    (``./x``, ``/abs/path``, ``a/b/c``) is a missing local path and fails here, naming the key.
    """
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not path.is_dir():
            raise FileNotFoundError(f"`{key}`: {name_or_path!r} is a file; expected a model folder with config.json")
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"`{key}`: model folder {name_or_path!r} has no config.json")
        return "local"
    looks_local = name_or_path.startswith((".", "/", "~")) or not _HUB_ID.match(name_or_path)
    if looks_local:
        raise FileNotFoundError(f"`{key}`: model path {name_or_path!r} does not exist")
    return "hub"


def load_tokenizer(name_or_path: str, *, trust_remote_code: bool = False, key: str = "model.name_or_path") -> Any:
    """Load the tokenizer and make sure it can pad (falls back to eos as pad, as most causal LMs need)."""
    from transformers import AutoTokenizer

    check_model_source(name_or_path, key=key)
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"`{key}`: tokenizer of {name_or_path!r} has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(
    name_or_path: str,
    *,
    dtype: str | torch.dtype | None = None,
    from_config: bool | None = None,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    key: str = "model.name_or_path",
    **from_pretrained_kwargs: Any,
) -> torch.nn.Module:
    """Load a causal LM with ``transformers``.

    Args:
        name_or_path: a local folder or a hub id.
        dtype: parameter dtype ("bfloat16", "float32", "auto" = the checkpoint's); None keeps the default.
        from_config: True initialises random weights from the config (no weights read); None decides
            by whether a local folder holds weights (a hub id always loads weights).
        attn_implementation: passed to transformers ("sdpa", "eager", "flash_attention_2").
        from_pretrained_kwargs: anything else for ``from_pretrained`` (``quantization_config``,
            ``device_map``, ``max_memory``, ``offload_folder``...).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    source = check_model_source(name_or_path, key=key)
    torch_dtype = resolve_dtype(dtype)
    if from_config is None:
        from_config = source == "local" and not has_weights(name_or_path)
    if from_config:
        if from_pretrained_kwargs:
            raise ValueError(
                f"`{key}`: {name_or_path!r} has no weights to load, so {sorted(from_pretrained_kwargs)} cannot apply"
            )
        config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
        kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
        if torch_dtype is not None:
            kwargs["dtype"] = torch_dtype
        if attn_implementation is not None:
            kwargs["attn_implementation"] = attn_implementation
        return AutoModelForCausalLM.from_config(config, **kwargs)
    kwargs = {"trust_remote_code": trust_remote_code, **from_pretrained_kwargs}
    kwargs["dtype"] = torch_dtype if torch_dtype is not None else ("auto" if dtype == "auto" else None)
    if kwargs["dtype"] is None:
        del kwargs["dtype"]
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    return AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)


def count_parameters(module: torch.nn.Module, *, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)
