"""LoRA adapters with peft: settings, target-module resolution, adapter export, reload and merge.

A LoRA adapter adds ``B @ A`` (rank ``r``) next to a frozen linear layer and trains only ``A`` and
``B``: ``r * (in + out)`` parameters per targeted layer instead of ``in * out``. The exported
adapter is peft's own format (``adapter_config.json`` + ``adapter_model.safetensors``), so any peft
user can load it; a small side file records how the base was loaded (quantized or not, dtype), so
that the exact model that was trained can be rebuilt (:func:`load_adapter_model`) or merged
(:func:`merge_adapter`). The same pieces serve LoRA on a bf16/fp32 base (the SFT recipe's
``model.lora``), QLoRA (a 4-bit base) and a LoRA actor in PPO: a saved base for a config-only
model (:func:`saved_base`), export, reload, merge and its command (:func:`merge_main`). Adapter-only
checkpoints are :mod:`lightning_mem.checkpointing`'s trainable-only checkpoints.
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
from dataclasses import asdict, dataclass
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from jsonargparse.typing import PositiveFloat, PositiveInt

import torch
from torch import nn

from lightning_mem.checkpointing import staged_directory
from lightning_mem.export import gather_state_dict
from lightning_mem.dtypes import resolve_dtype
from lightning_mem.models import building_config_only, check_model_source, has_weights, load_causal_lm, load_tokenizer
from lightning_mem.settings import HalfOpenUnitInterval, SettingError, SettingPathError, check_fields, settings_at
from lightning_mem.quantization import (
    QuantizationSettings,
    freeze_quantized_base,
    is_quantized_linear,
    load_quantized_causal_lm,
    materialize_random_weights,
)

ALL_LINEAR = "all-linear"
#: Written next to the adapter: how its base was loaded for training.
BASE_SIDECAR = "lightning_mem_base.json"


@dataclass
class LoraSettings:
    """LoRA's settings (in the recipes, the ``model.lora`` section of a config: SFT, QLoRA, PPO).

    The field names are peft's ``LoraConfig`` names, so a block copied from a peft script works.

    Args:
        r: rank of each adapter.
        lora_alpha: scale; the adapter's output is multiplied by ``lora_alpha / r``.
        lora_dropout: dropout on the adapter's input during training.
        target_modules: "all-linear" (every linear layer but the output head, as in the QLoRA
            paper), a list of module names (``q_proj`` matches every ``...q_proj``), or a regex
            matched against full module names.
        modules_to_save: modules trained in full and saved with the adapter (e.g. ``lm_head``
            after adding tokens).
        bias: which biases train: "none", "all" or "lora_only".
    """

    r: PositiveInt = 16
    lora_alpha: PositiveFloat = 32.0
    lora_dropout: HalfOpenUnitInterval = 0.05
    target_modules: str | list[str] = ALL_LINEAR
    modules_to_save: list[str] | None = None
    bias: Literal["none", "all", "lora_only"] = "none"

    def __post_init__(self) -> None:
        # The ranges are the annotations (the CLI checks them while parsing); these, a type cannot say.
        check_fields(self)
        if isinstance(self.target_modules, list) and not self.target_modules:
            raise SettingError("target_modules", f" is empty; use '{ALL_LINEAR}' or name some modules")
        if isinstance(self.target_modules, str) and self.target_modules != ALL_LINEAR:
            try:
                re.compile(self.target_modules)
            except re.error as err:
                raise SettingError("target_modules", f": {self.target_modules!r} is not a valid regex ({err})") from None


# ---------------------------------------------------------------------------------------------
# Which modules get adapters
# ---------------------------------------------------------------------------------------------


def meta_model(name_or_path: str, *, trust_remote_code: bool = False, auto_class: Any = None,
               config_kwargs: dict[str, Any] | None = None) -> nn.Module:
    """The model's module tree on the meta device: names and shapes, no memory, no weights read.

    Lets target names be checked before the real (slow, large) load. ``auto_class``: the
    ``transformers`` auto class the run loads with (default ``AutoModelForCausalLM``; a reward
    model's ``AutoModelForSequenceClassification``), with its ``config_kwargs`` (``num_labels``).
    """
    from lightning_mem.models import load_pretrained

    with torch.device("meta"):
        if auto_class is None:
            return load_causal_lm(name_or_path, from_config=True, trust_remote_code=trust_remote_code)
        return load_pretrained(auto_class, name_or_path, from_config=True, trust_remote_code=trust_remote_code,
                               config_kwargs=config_kwargs)


def _is_linear(module: nn.Module) -> bool:
    # bitsandbytes' Linear4bit and Linear8bitLt subclass nn.Linear, so a quantized model and its
    # full-precision (or meta) twin have the same linear modules.
    return isinstance(module, nn.Linear)


def linear_module_names(model: nn.Module) -> list[str]:
    """Full names of the model's linear layers, in module order."""
    return [name for name, module in model.named_modules() if name and _is_linear(module)]


def _short_names(names: list[str]) -> list[str]:
    return sorted({name.rsplit(".", 1)[-1] for name in names})


def _matches(key: str, name: str) -> bool:
    # peft's rule for a list entry: the full name, or a dotted suffix of it.
    return name == key or name.endswith(f".{key}")


#: The heads of ``transformers`` sequence classifiers (decoders name it ``score``, encoders
#: ``classifier``): output layers like an LM head, trained whole (``modules_to_save``), never adapted.
CLASSIFIER_HEADS = ("score", "classifier")


def _output_layer_names(model: nn.Module) -> set[str]:
    """The full names of ``model``'s output layers: its LM head, or a sequence classifier's head."""
    get = getattr(model, "get_output_embeddings", None)
    heads = [get() if callable(get) else None]
    heads += [getattr(model, name, None) for name in CLASSIFIER_HEADS]
    heads = [head for head in heads if isinstance(head, nn.Module)]
    return {name for name, module in model.named_modules() if any(module is head for head in heads)}


def resolve_target_modules(model: nn.Module, target_modules: str | list[str]) -> list[str] | str:
    """Turn ``target_modules`` into what peft gets, or raise naming the model's linear modules.

    "all-linear" becomes the short names of every linear layer except the output head (an LM head,
    or a sequence classifier's ``score``; the same set as peft's shorthand, but explicit in
    ``adapter_config.json`` and checkable here).
    A list entry, or a regex, that matches no linear layer is an error: a typo would otherwise
    train fewer adapters than meant, silently (peft only fails when *nothing* matches).
    """
    linears = linear_module_names(model)
    heads = _output_layer_names(model)

    def fail(what: str) -> SettingError:
        return SettingError(
            "target_modules",
            f": {what} of {type(model).__name__}; its linear modules are "
            f"{_short_names(linears)} (full names like {linears[0]!r})"
            if linears
            else f": {type(model).__name__} has no linear modules",
        )

    if target_modules == ALL_LINEAR:
        names = _short_names([n for n in linears if n not in heads])
        if not names:
            raise fail("no linear layer besides the output head")
        return names
    if isinstance(target_modules, str):
        if not any(re.fullmatch(target_modules, n) for n in linears):
            raise fail(f"regex {target_modules!r} matches no linear module")
        return target_modules
    unmatched = [key for key in target_modules if not any(_matches(key, n) for n in linears)]
    if unmatched:
        raise fail(f"{unmatched} match{'es' if len(unmatched) == 1 else ''} no linear module")
    return list(target_modules)


def check_modules_to_save(model: nn.Module, modules_to_save: list[str] | None) -> None:
    if not modules_to_save:
        return
    names = [name for name, _ in model.named_modules() if name]
    unmatched = [key for key in modules_to_save if not any(_matches(key, n) for n in names)]
    if unmatched:
        top = sorted({n.rsplit(".", 1)[-1] for n in names if "." not in n or n.count(".") <= 1})
        raise SettingError("modules_to_save", f": {unmatched} name no module of {type(model).__name__} (e.g. {top})")


def check_lora_targets(model: nn.Module, settings: LoraSettings) -> list[str] | str:
    """Validate ``settings`` against ``model`` (a meta twin will do); returns the resolved targets.

    Raises:
        SettingError: naming the field of ``settings`` (``target_modules``, ``modules_to_save``).
    """
    targets = resolve_target_modules(model, settings.target_modules)
    check_modules_to_save(model, settings.modules_to_save)
    return targets


def build_lora_config(settings: LoraSettings, target_modules: list[str] | str, task_type: str = "CAUSAL_LM") -> Any:
    """peft's ``LoraConfig``; ``task_type`` is peft's (``CAUSAL_LM``, or ``SEQ_CLS`` for a reward model,
    whose ``score`` head peft then trains whole)."""
    from peft import LoraConfig

    return LoraConfig(
        r=settings.r,
        lora_alpha=settings.lora_alpha,
        lora_dropout=settings.lora_dropout,
        target_modules=target_modules,
        modules_to_save=list(settings.modules_to_save) if settings.modules_to_save else None,
        bias=settings.bias,
        task_type=task_type,
    )


def apply_lora(model: nn.Module, settings: LoraSettings, task_type: str = "CAUSAL_LM") -> nn.Module:
    """Wrap ``model`` in a peft model with fresh adapters; only adapter parameters train.

    Raises:
        SettingError: naming ``lora.<field>`` for a target that matches nothing, and
            ``device_map`` for adapters that would sit on layers offloaded to disk.
    """
    from peft import get_peft_model

    with settings_at("lora"):
        targets = check_lora_targets(model, settings)
    peft_model = get_peft_model(model, build_lora_config(settings, targets, task_type))
    on_meta = [n for n, p in peft_model.named_parameters() if p.requires_grad and p.device.type == "meta"]
    if on_meta:
        # A layer that device_map sent to disk lives on the meta device between forwards; its
        # adapter would be created there too and could never take an optimizer step.
        raise SettingError(
            "device_map",
            f": {len(on_meta)} trainable adapter parameters sit on layers offloaded to disk "
            f"(e.g. {on_meta[0]}); keep those layers on a device or leave them out of `lora.target_modules`",
            siblings=("lora.target_modules",),
        )
    return peft_model


# ---------------------------------------------------------------------------------------------
# Export, reload, merge
# ---------------------------------------------------------------------------------------------


def export_adapter(
    trainer: Any,
    model: nn.Module,
    tokenizer: Any,
    out_dir: str | Path,
    *,
    base: dict[str, Any],
) -> None:
    """Write the adapter in peft format, the tokenizer, and :data:`BASE_SIDECAR` to ``out_dir``.

    ``base`` records how the base was loaded (``quantization`` settings as a dict,
    ``attn_implementation``, ``trust_remote_code``); peft's ``adapter_config.json`` already names
    the base model itself.
    """
    # Only what trains is gathered: the frozen base can be tens of GB and is not part of the adapter.
    state = gather_state_dict(trainer, model, trainable_only=True)
    if state is not None:
        # Written beside out_dir and renamed into place: a failure leaves no half-written adapter.
        with staged_directory(out_dir) as out:
            # save_embedding_layers=False: the vocabulary is never resized here, and "auto" would ask
            # the hub about the base's config.
            model.save_pretrained(out, state_dict=state, safe_serialization=True, save_embedding_layers=False)
            if tokenizer is not None:
                tokenizer.save_pretrained(out)
            (out / BASE_SIDECAR).write_text(json.dumps(base, indent=2, sort_keys=True) + "\n")
    trainer.strategy.barrier("export_adapter")


def _read_adapter(adapter_dir: str | Path) -> tuple[dict[str, Any], dict[str, Any] | None]:
    folder = Path(adapter_dir)
    config_file = folder / "adapter_config.json"
    if not config_file.is_file():
        raise SettingPathError("--adapter", f": {str(adapter_dir)!r} has no adapter_config.json")
    sidecar = folder / BASE_SIDECAR
    return json.loads(config_file.read_text()), (json.loads(sidecar.read_text()) if sidecar.is_file() else None)


def _base_of(adapter_config: dict[str, Any], base: str | None) -> str:
    base = base or adapter_config.get("base_model_name_or_path")
    if not base:
        raise SettingError("--base", ": the adapter does not name its base model; pass --base")
    check_model_source(base, key="--base")
    return base


def load_adapter_model(adapter_dir: str | Path, *, base: str | None = None, **placement: Any) -> nn.Module:
    """Rebuild the trained model: the base quantized as in training, prepared the same way, plus the adapter.

    Gives the trained model's outputs exactly (same quantized codes, same dtypes, same adapter
    weights). ``placement``: ``device_map``/``max_memory``/``offload_folder`` for ``from_pretrained``.
    """
    from peft import PeftModel

    adapter_config, sidecar = _read_adapter(adapter_dir)
    if sidecar is None:
        raise FileNotFoundError(f"{adapter_dir}: no {BASE_SIDECAR}, so how the base was loaded is unknown")
    base_path = _base_of(adapter_config, base)
    trust = sidecar.get("trust_remote_code", False)
    if sidecar.get("quantization") is None:  # plain LoRA: the base in the dtype training loaded it in
        model = load_causal_lm(
            base_path, dtype=sidecar.get("dtype"), from_config=False,
            attn_implementation=sidecar.get("attn_implementation"), trust_remote_code=trust, **placement,
        )
    else:
        model = load_quantized_causal_lm(
            base_path,
            QuantizationSettings(**sidecar["quantization"]),
            attn_implementation=sidecar.get("attn_implementation"),
            trust_remote_code=trust,
            **placement,
        )
        # The unquantized parameters in the dtype training held them in (fp32 for an adapter
        # recorded before that dtype was: peft's upcast, which training then applied).
        model = freeze_quantized_base(model, resolve_dtype(sidecar.get("dtype"), key="dtype") or torch.float32)
    return PeftModel.from_pretrained(model, str(adapter_dir)).eval()


BaseWeights = Literal["dequantized", "original"]


def merge_adapter(
    adapter_dir: str | Path,
    out_dir: str | Path,
    *,
    base: str | None = None,
    base_weights: BaseWeights = "dequantized",
    dtype: str = "bfloat16",
) -> Path:
    """Fold the adapter into a ``dtype`` copy of its base and save a plain Hugging Face model.

    ``base_weights``:
      - "dequantized": the base as training saw it, quantized exactly as recorded in
        :data:`BASE_SIDECAR` and dequantized to ``dtype``. The merged model then computes what the
        trained model computed (up to ``dtype`` rounding): the adapter learned to correct *those*
        weights. Needs the base to fit in ``dtype`` on the device it loads to (run on CPU with
        ``CUDA_VISIBLE_DEVICES=`` for models larger than the card).
      - "original": the base checkpoint as it is on disk, in ``dtype`` (peft's usual merge). The
        adapter's correction then lands on slightly different weights than it was trained on.
    """
    from peft import PeftModel

    torch_dtype = resolve_dtype(dtype, key="--dtype")
    if torch_dtype is None:
        raise SettingError("--dtype", f" must name a dtype, not {dtype!r}")
    adapter_config, sidecar = _read_adapter(adapter_dir)
    base_path = _base_of(adapter_config, base)
    trust = bool(sidecar and sidecar.get("trust_remote_code"))
    if sidecar is not None and sidecar.get("quantization") is None and base_weights in ("dequantized", "original"):
        # A plain LoRA adapter: its base was never quantized, both choices are the checkpoint itself.
        model = load_causal_lm(base_path, dtype=torch_dtype, from_config=False, trust_remote_code=trust)
    elif base_weights == "dequantized":
        if sidecar is None:
            raise SettingPathError(
                "--adapter",
                f": {adapter_dir} has no {BASE_SIDECAR}, so how its base was quantized is unknown; use --base_weights original",
            )
        settings = QuantizationSettings(**sidecar["quantization"])
        model = load_quantized_causal_lm(base_path, settings, trust_remote_code=trust)
        # transformers replaces each quantized linear by a dense one (and drops the quantization
        # config, so the saved model is a plain checkpoint); the other modules follow to dtype.
        model = model.dequantize(dtype=torch_dtype).to(torch_dtype)
    elif base_weights == "original":
        model = load_causal_lm(base_path, dtype=torch_dtype, from_config=False, trust_remote_code=trust)
    else:
        raise SettingError("--base_weights", f" must be 'dequantized' or 'original', got {base_weights!r}")
    assert not any(is_quantized_linear(m) for m in model.modules())
    merged = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    out = Path(out_dir)
    merged.save_pretrained(out, safe_serialization=True)
    # The tokenizer exported with the adapter is the one training used; else the base's.
    if (Path(adapter_dir) / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(adapter_dir), trust_remote_code=trust)
    else:
        tokenizer = load_tokenizer(base_path, trust_remote_code=trust, key="--base")
    tokenizer.save_pretrained(out)
    return out


def base_record(
    settings: QuantizationSettings | None,
    *,
    attn_implementation: str | None,
    trust_remote_code: bool,
    dtype: str | None = None,
) -> dict[str, Any]:
    """What :data:`BASE_SIDECAR` holds: enough to load the base exactly as training did.

    ``dtype``: with ``settings`` None, the dtype a plain base loaded in; with ``settings``, the
    dtype its unquantized parameters were held in (:func:`~lightning_mem.quantization.freeze_quantized_base`).
    """
    return {
        "quantization": None if settings is None else asdict(settings),
        "dtype": dtype,
        "attn_implementation": attn_implementation,
        "trust_remote_code": trust_remote_code,
    }


# ---------------------------------------------------------------------------------------------
# Training with adapters: the base on disk, adapter-only checkpoints
# ---------------------------------------------------------------------------------------------


def saved_base(trainer: Any, name_or_path: str, cache_dir: str, *, seed: int) -> str:
    """The base to load: ``name_or_path`` itself, or, for a config-only folder (like
    ``assets/tiny-llama``), seeded random weights saved once under ``cache_dir`` (relative to
    ``trainer.default_root_dir``). An adapter must name a base that exists with its weights, or it
    could never be reloaded or merged. One process writes them; the others wait, then read them.
    """
    if not (Path(name_or_path).is_dir() and not has_weights(name_or_path)):
        return name_or_path
    if building_config_only():  # the memory estimate: fake tensors, nothing to write (see there)
        return name_or_path
    cache = Path(trainer.default_root_dir) / cache_dir
    if trainer.is_global_zero:
        materialize_random_weights(name_or_path, cache, seed=seed)
    trainer.strategy.barrier("materialize_random_weights")
    return str(materialize_random_weights(name_or_path, cache, seed=seed))


# ---------------------------------------------------------------------------------------------
# Sampling with the adapters merged (a rollout), and the base weights back bit for bit after
# ---------------------------------------------------------------------------------------------


def _mergeable_lora_layers(model: nn.Module) -> list[nn.Module]:
    """The LoRA layers whose active adapters can be merged into a plain floating base weight: not
    a 4-bit base, not a DTensor shard, plain LoRA (no DoRA-style variant), no adapter bias, adapters
    enabled and not merged already. The others keep computing their adapters beside the base."""
    if "peft.tuners.lora" not in sys.modules:
        # No LoRA layer exists before peft's LoRA module is imported; importing it here would
        # import bitsandbytes too (peft does), and its import-time log lines, for a plain model.
        return []
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # peft is a dependency; a model without it has no adapters to merge
        return []
    from torch.distributed.tensor import DTensor

    layers = []
    for module in model.modules():
        if not isinstance(module, LoraLayer) or module.merged or module.disable_adapters:
            continue
        weight = getattr(module.get_base_layer(), "weight", None)
        # A 4-bit base is stored as integers; a DTensor is one rank's shard. (The estimate's fake
        # tensors are neither, and merge as the real ones do.)
        if weight is None or isinstance(weight, DTensor) or not weight.is_floating_point() or weight.device.type == "meta":
            continue
        active = [a for a in module.active_adapters if a in module.lora_A]
        if not active or any(a in getattr(module, "lora_variant", {}) or getattr(module, "lora_bias", {}).get(a)
                             for a in active):
            continue
        layers.append(module)
    return layers


@contextlib.contextmanager
def merged_adapters(model: nn.Module, *, enabled: bool = True) -> Iterator[int]:
    """Inside: the model's LoRA adapters merged into their base weights (a forward then costs one
    matmul per layer, not three); yields how many layers were merged.

    peft's own ``unmerge`` subtracts the adapter again, which in bf16 does not give back the same
    bits. Here each merged base weight is copied to the host first and copied back in place after
    (same storage: compiled graphs and optimizers keep pointing at it), so the weights that train
    are the ones that were there before, bit for bit. Costs one host copy of the merged layers'
    weights, for the time of the block.
    """
    layers = _mergeable_lora_layers(model) if enabled else []
    saved: list[tuple[nn.Module, torch.Tensor, torch.Tensor]] = []
    try:
        with torch.no_grad():
            for layer in layers:
                weight = layer.get_base_layer().weight
                saved.append((layer, weight, weight.detach().to("cpu", copy=True)))
                layer.merge(adapter_names=[a for a in layer.active_adapters if a in layer.lora_A])
        yield len(layers)
    finally:
        with torch.no_grad():
            for layer, weight, original in saved:
                weight.detach().copy_(original)
                layer.merged_adapters.clear()


# ---------------------------------------------------------------------------------------------
# The merge command: ``python -m recipes.<sft|qlora> merge ...``
# ---------------------------------------------------------------------------------------------


def merge_main(args: list[str], *, prog: str) -> Path:
    """``<prog> --adapter DIR --out DIR [--base ...] [--base_weights ...] [--dtype ...]``."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(prog=prog, description=merge_adapter.__doc__.split("\n")[0])
    parser.add_argument("--adapter", required=True, help="folder with adapter_config.json (a run's export/)")
    parser.add_argument("--out", required=True, help="folder for the merged Hugging Face model")
    parser.add_argument("--base", default=None, help="base model; default: the one adapter_config.json names")
    parser.add_argument(
        "--base_weights",
        default="dequantized",
        choices=["dequantized", "original"],
        help="a 4-bit base: dequantized = the base training saw (reproduces the trained model); original ="
        " the checkpoint. A plain LoRA base: the same either way",
    )
    parser.add_argument("--dtype", default="bfloat16", help="dtype of the merged model")
    cfg = parser.parse_args(args)
    out = merge_adapter(cfg.adapter, cfg.out, base=cfg.base, base_weights=cfg.base_weights, dtype=cfg.dtype)
    print(f"merged {cfg.adapter} into its base ({cfg.base_weights} weights, {cfg.dtype}): {out}")
    return out
