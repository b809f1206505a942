"""Quantize a frozen base model with bitsandbytes while it loads, and count what its weights cost.

QLoRA keeps the base in 4-bit NormalFloat (NF4), quantizes the per-block scales once more (double
quantization), and dequantizes block by block to a compute dtype for every matmul. bitsandbytes does
this inside ``from_pretrained``: the weights are quantized as they are read, so the full-precision
model never has to fit in memory. That needs weights on disk, so a config-only model folder (the
shipped tiny model) is first given seeded random weights, saved once, and then loaded through the
very same ``from_pretrained(..., quantization_config=...)`` call a real checkpoint takes.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from lightning_mem.dtypes import resolve_dtype
from lightning_mem.settings import SettingError, SettingNotSupported, check_fields
from lightning_mem.models import building_config_only, has_weights, load_causal_lm, load_tokenizer



@dataclass
class QuantizationSettings:
    """How bitsandbytes stores the frozen base (in the recipes, the ``model.quantization`` section).

    Args:
        bits: 4 for QLoRA (``Linear4bit``), 8 for LLM.int8 (``Linear8bitLt``).
        quant_type: 4-bit data type: "nf4" (NormalFloat, the QLoRA paper's) or "fp4".
        double_quant: quantize the per-block absmax scales to 8 bits too (saves ~0.37 bit/param).
        compute_dtype: dtype the 4-bit weights are dequantized to for each matmul; also the dtype
            the non-quantized modules (embeddings, norms, lm_head) are read in.
        quant_storage: dtype the packed 4-bit bytes are stored as. Leave None (uint8) on one
            device; set it to the sharding dtype (e.g. "bfloat16") when FSDP2 shards the base,
            so the packed weights are plain tensors of the dtype FSDP2 flattens (docs/qlora.md).
        skip_modules: module names kept unquantized; None keeps transformers' default (the
            output layer, whose error would go straight into the logits).
    """

    bits: Literal[4, 8] = 4
    quant_type: Literal["nf4", "fp4"] = "nf4"
    double_quant: bool = True
    compute_dtype: str = "bfloat16"
    quant_storage: str | None = None
    skip_modules: list[str] | None = None

    def __post_init__(self) -> None:
        check_fields(self)  # the Literal fields, for a settings object built in Python
        # What a type cannot express: a dtype name, and a rule relating two fields.
        if resolve_dtype(self.compute_dtype, key="compute_dtype") is None:
            raise SettingError("compute_dtype", f" must name a dtype, not {self.compute_dtype!r}")
        if self.quant_storage is not None:
            if self.bits == 8:
                raise SettingError("quant_storage", " applies to 4-bit weights only (bits is 8)")
            _storage_dtype(self.quant_storage)

    @property
    def torch_compute_dtype(self) -> torch.dtype:
        dtype = resolve_dtype(self.compute_dtype, key="compute_dtype")
        assert dtype is not None
        return dtype


def _storage_dtype(name: str) -> torch.dtype:
    if name == "uint8":
        return torch.uint8
    dtype = resolve_dtype(name, key="quant_storage")
    if dtype is None:
        raise SettingError("quant_storage", f" must name a dtype, not {name!r}")
    return dtype


def build_bnb_config(settings: QuantizationSettings, *, cpu_offload: bool = False) -> Any:
    """The ``transformers.BitsAndBytesConfig`` for ``settings``.

    ``cpu_offload`` allows a ``device_map`` that puts some modules on "cpu" or "disk": bitsandbytes
    then keeps those modules unquantized in fp32 (its kernels only run on the accelerator it
    quantized for), which is what ``llm_int8_enable_fp32_cpu_offload`` means for 4-bit models too.
    """
    from transformers import BitsAndBytesConfig

    common: dict[str, Any] = {"llm_int8_enable_fp32_cpu_offload": cpu_offload}
    if settings.skip_modules is not None:
        common["llm_int8_skip_modules"] = list(settings.skip_modules)
    if settings.bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True, **common)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=settings.quant_type,
        bnb_4bit_use_double_quant=settings.double_quant,
        bnb_4bit_compute_dtype=settings.torch_compute_dtype,
        bnb_4bit_quant_storage=_storage_dtype(settings.quant_storage or "uint8"),
        **common,
    )


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def materialize_random_weights(name_or_path: str, cache_root: str | Path, *, seed: int) -> Path:
    """Give a config-only model folder seeded random weights on disk, once; return that folder.

    The folder is named by a hash of the config and the seed, so the same config and seed always
    give the same weights (and a second run reuses them), while a changed config gets a new one.
    It holds config, safetensors and tokenizer: a complete Hugging Face model that adapters
    trained on it can name as their base. Written to a temporary name and renamed, so a reader
    never sees half a folder.
    """
    config_text = (Path(name_or_path) / "config.json").read_bytes()
    digest = hashlib.sha256(config_text + f"seed={seed}".encode()).hexdigest()[:12]
    target = (Path(cache_root) / f"{Path(name_or_path).name}-seed{seed}-{digest}").resolve()
    if has_weights(target):
        return target
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    # fork_rng: drawing the weights must not move the training RNG that seed_everything set.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = load_causal_lm(name_or_path, from_config=True)
    model.save_pretrained(tmp, safe_serialization=True)
    load_tokenizer(name_or_path).save_pretrained(tmp)
    try:
        os.replace(tmp, target)
    except OSError:  # another process finished first: its weights are the same (same seed)
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def offloads_to_host(device_map: str | dict[str, Any] | None) -> bool:
    """Whether a ``device_map`` may place modules on "cpu" or "disk" (then they stay unquantized)."""
    if device_map is None:
        return False
    if isinstance(device_map, str):  # "auto", "balanced", ...: decided at load time by max_memory
        return device_map not in ("cuda",) and not device_map.startswith("cuda:")
    return any(str(v) in ("cpu", "disk") for v in device_map.values())


def check_placement(
    device_map: str | dict[str, Any] | None, max_memory: dict[Any, str] | None, offload_folder: str | None
) -> None:
    """Fail on placement settings that ``from_pretrained`` would reject later (or silently ignore),
    naming the argument (a :class:`~lightning_mem.settings.SettingError`)."""
    if max_memory is not None and device_map is None:
        raise SettingError("max_memory", " needs `device_map` (e.g. 'auto') to have any effect", siblings=("device_map",))
    if isinstance(device_map, dict) and "disk" in {str(v) for v in device_map.values()} and not offload_folder:
        raise SettingError(
            "device_map", " puts modules on 'disk': set `offload_folder` to a folder for them", siblings=("offload_folder",)
        )


def load_quantized_causal_lm(
    name_or_path: str,
    settings: QuantizationSettings,
    *,
    random_init_dir: str | Path | None = None,
    init_seed: int = 0,
    device_map: str | dict[str, Any] | None = None,
    max_memory: dict[Any, str] | None = None,
    offload_folder: str | None = None,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
) -> nn.Module:
    """Load a causal LM with its linear layers quantized by bitsandbytes as they are read.

    A local folder without weights gets seeded random ones in ``random_init_dir`` first
    (:func:`materialize_random_weights`); everything else loads as it is.
    """
    check_placement(device_map, max_memory, offload_folder)
    path = str(name_or_path)
    if Path(path).is_dir() and not has_weights(path) and building_config_only():
        if device_map is not None:
            raise SettingNotSupported(
                "device_map",
                ": a base placed over several devices (or host, or disk) cannot be built "
                "from its config alone, so the memory estimator does not cover it",
            )
        return quantized_causal_lm_from_config(
            path, settings, attn_implementation=attn_implementation, trust_remote_code=trust_remote_code
        )
    if Path(path).is_dir() and not has_weights(path):
        if random_init_dir is None:
            raise SettingError(
                "name_or_path", f": {path!r} has only a config; set `random_init_dir`", siblings=("random_init_dir",)
            )
        path = str(materialize_random_weights(path, random_init_dir, seed=init_seed))
    placement = {
        k: v
        for k, v in {"device_map": device_map, "max_memory": max_memory, "offload_folder": offload_folder}.items()
        if v is not None
    }
    model = load_causal_lm(
        path,
        # The non-quantized modules are read in the compute dtype: reading them in fp32 would
        # double their load-time peak for nothing (peft upcasts the few that need it).
        dtype=settings.torch_compute_dtype,
        from_config=False,
        attn_implementation=attn_implementation,
        trust_remote_code=trust_remote_code,
        quantization_config=build_bnb_config(settings, cpu_offload=offloads_to_host(device_map)),
        **placement,
    )
    keep_training_layout(model)
    return model


def quantized_causal_lm_from_config(
    name_or_path: str,
    settings: QuantizationSettings,
    *,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
) -> nn.Module:
    """What :func:`load_quantized_causal_lm` returns, built from ``config.json`` alone (random weights).

    The steps of ``from_pretrained(..., quantization_config=...)`` without a checkpoint: the model
    is made in the compute dtype; transformers' own quantizer swaps its linear layers for
    bitsandbytes ones (the same modules it skips: the output layer, ``skip_modules``); each layer's
    weight is then quantized by the conversion op ``from_pretrained`` applies to a weight it reads
    (``Params4bit(...).to(device)``: bitsandbytes' ``quantize_4bit``, and ``quantize_blockwise``
    for the double-quantized absmax), so packed weights and quantization state have exactly the
    shapes and dtypes a loaded checkpoint gets. Only used inside
    :func:`~lightning_mem.models.config_only_models` (the memory estimator, on fake tensors):
    a run trains on weights that can be saved and named, which these are not.
    """
    import bitsandbytes as bnb
    from transformers.quantizers import AutoHfQuantizer

    model = load_causal_lm(
        name_or_path, dtype=settings.torch_compute_dtype, from_config=True,
        attn_implementation=attn_implementation, trust_remote_code=trust_remote_code,
    )
    dense = {name: m for name, m in model.named_modules() if type(m) is nn.Linear}
    model.config.quantization_config = build_bnb_config(settings)
    quantizer = AutoHfQuantizer.from_config(model.config.quantization_config, pre_quantized=False)
    quantizer.preprocess_model(model=model, dtype=settings.torch_compute_dtype, device_map={"": "cpu"})
    convert = quantizer.get_quantize_ops().convert
    quantized = (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)
    for name, layer in model.named_modules():
        if not isinstance(layer, quantized) or name not in dense:
            continue
        source = dense.pop(name)
        key = f"{name}.weight"
        weight = convert({key: source.weight.detach()}, full_layer_name=key, model=model)[key]
        layer.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        if source.bias is not None:
            layer.bias = nn.Parameter(source.bias.detach(), requires_grad=False)
        layer._is_hf_initialized = True
    del dense
    model.hf_quantizer = quantizer
    quantizer.postprocess_model(model)
    keep_training_layout(model)
    return model.eval()  # as from_pretrained returns it


def freeze_quantized_base(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Freeze every parameter of a quantized base and hold its unquantized ones in ``dtype``.

    The unquantized parameters are the embeddings, norms, output layer and biases (and, with a
    ``device_map`` that offloads, whole layers). peft's ``prepare_model_for_kbit_training`` freezes
    too, but always upcasts them to fp32: under ``bf16-mixed`` they feed bf16 matmuls anyway, and
    for Llama-3.1-8B the embedding and output layer alone are 2.1 GB more in fp32. The recipes pass
    the frozen role's dtype (:meth:`lightning_mem.dtypes.PrecisionDtypes.load_dtype`): the
    compute dtype, fp32 under ``32-true``. Packed 4-bit weights keep their storage dtype (with
    ``quant_storage`` it is a float dtype that only carries the codes).
    """
    import bitsandbytes as bnb

    for param in model.parameters():
        param.requires_grad_(False)
        if param.is_floating_point() and param.dtype != dtype and not isinstance(param, bnb.nn.Params4bit):
            param.data = param.data.to(dtype)
    return model


def keep_training_layout(model: nn.Module) -> int:
    """Stop bitsandbytes from repacking 4-bit weights into its CPU inference layout; returns how many layers.

    On a CPU with AVX512-BF16, bitsandbytes 0.50 repacks a ``Linear4bit``'s weight in place the
    first time it runs in eval mode without grad (a validation step) and from then on multiplies
    with an inference kernel that has no backward, so training after the first validation would
    lose the gradient through every base layer; the repacking also asserts that out_features is
    a multiple of 32. The layer reads its per-instance ``support_avx512bf16_for_cpu`` flag to
    decide, so clearing it keeps the one layout both training and evaluation can use.
    """
    import bitsandbytes as bnb

    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    for layer in layers:
        layer.support_avx512bf16_for_cpu = False
    return len(layers)


# ---------------------------------------------------------------------------------------------
# Byte accounting
# ---------------------------------------------------------------------------------------------


def quant_state_tensors(weight: nn.Parameter) -> list[torch.Tensor]:
    """Every tensor that a quantized weight needs besides its packed bytes (scales, code books)."""
    import bitsandbytes as bnb

    tensors: list[torch.Tensor] = []
    if isinstance(weight, bnb.nn.Params4bit):
        state = weight.quant_state
        tensors += [state.absmax, state.code]
        if state.nested:  # double quantization: the absmax is 8-bit, with its own fp32 scales
            tensors += [state.offset, state.state2.absmax, state.state2.code]
    elif isinstance(weight, bnb.nn.Int8Params):
        tensors += [t for t in (weight.SCB,) if t is not None]  # CB is the weight's own storage
    return [t for t in tensors if isinstance(t, torch.Tensor)]


def is_quantized_linear(module: nn.Module) -> bool:
    import bitsandbytes as bnb

    return isinstance(module, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))


def quantized_weight_bytes(model: nn.Module) -> tuple[int, int]:
    """``(bytes held, bf16 bytes the same weights would take)`` over the model's quantized linears.

    Bytes held are exact: the packed weights plus every quantization-state tensor (absmax, nested
    absmax, code books, offset), each storage counted once. Biases stay in full precision and are
    left out of both sides.
    """
    seen: set[int] = set()
    held = dense = 0

    def add(t: torch.Tensor) -> None:
        nonlocal held
        storage = t.untyped_storage()
        # The storage itself, not its data pointer: a fake tensor's (the memory estimate) is 0.
        if storage._cdata not in seen:
            seen.add(storage._cdata)
            held += storage.nbytes()

    for module in model.modules():
        if not is_quantized_linear(module):
            continue
        add(module.weight.data)
        for t in quant_state_tensors(module.weight):
            add(t)
        dense += module.in_features * module.out_features * torch.finfo(torch.bfloat16).bits // 8
    return held, dense
