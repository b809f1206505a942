"""Load a Hugging Face causal LM and its tokenizer: from weights, or from a config alone.

The same code path serves a real checkpoint (a local folder with weights, or a hub id) and the
shipped tiny model (a folder with only config.json and tokenizer files, initialised at random).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from lightning_mem.dtypes import resolve_dtype
from lightning_mem.settings import SettingError, SettingPathError

_WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json", "*.pt")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
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


def has_weights(path: str | os.PathLike) -> bool:
    """True when a local model folder holds weight files, not just a config."""
    folder = Path(path)
    return any(any(folder.glob(pattern)) for pattern in _WEIGHT_PATTERNS)


def check_model_source(name_or_path: str, *, key: str = "name_or_path") -> str:
    """Validate a model location before anything heavy happens; returns "local" or "hub".

    A string that exists on disk is a local folder and must hold a config.json. A string that does
    not exist is taken for a hub id only when it looks like one (``org/name``); anything else
    (``./x``, ``/abs/path``, ``a/b/c``) is a missing local path and fails here, naming ``key``
    (a :class:`~lightning_mem.settings.SettingPathError`, which is a ``FileNotFoundError``).
    """
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not path.is_dir():
            raise SettingPathError(key, f": {name_or_path!r} is a file; expected a model folder with config.json")
        if not (path / "config.json").is_file():
            raise SettingPathError(key, f": model folder {name_or_path!r} has no config.json")
        return "local"
    looks_local = name_or_path.startswith((".", "/", "~")) or not _HUB_ID.match(name_or_path)
    if looks_local:
        raise SettingPathError(key, f": model path {name_or_path!r} does not exist")
    return "hub"


def load_tokenizer(name_or_path: str, *, trust_remote_code: bool = False, key: str = "name_or_path") -> Any:
    """Load the tokenizer and make sure it can pad (falls back to eos as pad, as most causal LMs need)."""
    from transformers import AutoTokenizer

    check_model_source(name_or_path, key=key)
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise SettingError(key, f": tokenizer of {name_or_path!r} has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def dtype_key(key: str) -> str:
    """The key of a model's dtype, next to its location key (``critic.name_or_path`` ->
    ``critic.dtype``)."""
    return key.rsplit(".", 1)[0] + ".dtype" if "." in key else "dtype"


def load_pretrained(
    auto_class: Any,
    name_or_path: str,
    *,
    dtype: str | torch.dtype | None = None,
    from_config: bool | None = None,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    key: str = "name_or_path",
    config_kwargs: dict[str, Any] | None = None,
    report_missing: bool = False,
    **from_pretrained_kwargs: Any,
) -> torch.nn.Module:
    """Load a model with a ``transformers`` auto class (``AutoModelForCausalLM``, ``AutoModel``,
    ``AutoModelForSequenceClassification``...): from weights, or at random from a config alone.

    Args:
        auto_class: the ``transformers`` auto class whose ``from_config``/``from_pretrained`` build it.
        name_or_path: a local folder or a hub id.
        dtype: parameter dtype ("bfloat16", "float32", "auto" = the checkpoint's); None keeps the default.
        from_config: True initialises random weights from the config (no weights read); None decides
            by whether a local folder holds weights (a hub id always loads weights).
        attn_implementation: passed to transformers ("sdpa", "eager", "flash_attention_2").
        key: what errors call ``name_or_path`` (a recipe passes its config key, such as
            ``model.critic.name_or_path``); its dtype key is its sibling.
        config_kwargs: config attributes to set either way (e.g. ``num_labels=1``).
        report_missing: load quietly and warn once, naming the weights the checkpoint lacks (for a
            class other than the checkpoint's, e.g. a backbone read from a causal-LM checkpoint,
            where transformers would otherwise report the unused head on every run).
        from_pretrained_kwargs: anything else for ``from_pretrained`` (``quantization_config``,
            ``device_map``, ``max_memory``, ``offload_folder``...).
    """
    from transformers import AutoConfig

    source = check_model_source(name_or_path, key=key)
    torch_dtype = resolve_dtype(dtype, key=dtype_key(key))
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if from_config is None:
        from_config = source == "local" and not has_weights(name_or_path)
    if from_config:
        if from_pretrained_kwargs:
            raise SettingError(
                key, f": {name_or_path!r} has no weights to load, so {sorted(from_pretrained_kwargs)} cannot apply"
            )
        config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code, **(config_kwargs or {}))
        if torch_dtype is not None:
            kwargs["dtype"] = torch_dtype
        return auto_class.from_config(config, **kwargs)
    kwargs.update(config_kwargs or {}, **from_pretrained_kwargs)
    if torch_dtype is not None or dtype == "auto":
        kwargs["dtype"] = torch_dtype if torch_dtype is not None else "auto"
    if not report_missing:
        return auto_class.from_pretrained(name_or_path, **kwargs)
    return _load_reporting_missing(auto_class, name_or_path, key, kwargs)


def _load_reporting_missing(auto_class: Any, name_or_path: str, key: str, kwargs: dict[str, Any]) -> torch.nn.Module:
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model, info = auto_class.from_pretrained(name_or_path, output_loading_info=True, **kwargs)
    finally:
        hf_logging.set_verbosity(verbosity)
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        warnings.warn(f"`{key}` ({name_or_path}): the checkpoint has no weights for {shown}; they start at random")
    return model


def load_causal_lm(name_or_path: str, **kwargs: Any) -> torch.nn.Module:
    """:func:`load_pretrained` with ``AutoModelForCausalLM`` (the policy, the SFT model)."""
    from transformers import AutoModelForCausalLM

    return load_pretrained(AutoModelForCausalLM, name_or_path, **kwargs)


def count_parameters(module: torch.nn.Module, *, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)
