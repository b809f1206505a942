"""The actor's weights as an engine with a copy of its own takes them (the weight sync).

Weight sync walks the actor's weights in checkpoint (Hugging Face) names and hands them to the
engine in buckets of at most ``sync_bucket_mb``: only a bucket's worth of converted (dtype-cast, or
LoRA-merged) tensors exists at any moment, never a second full copy of the model. Sharded weights
(FSDP2's DTensors) are cast shard by shard and then gathered whole, one tensor at a time: a
collective, so every rank that holds a shard walks the same weights in the same order.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn


def _lora_merged(module: nn.Module) -> Tensor | None:
    """A peft LoRA layer's merged weight (base + every active adapter's delta), or None for others."""
    if not (hasattr(module, "base_layer") and hasattr(module, "lora_A") and hasattr(module, "get_delta_weight")):
        return None
    weight = module.get_base_layer().weight.detach()
    adapters = module.active_adapters if not getattr(module, "disable_adapters", False) else []
    if module.merged:  # already folded in: the base weight is the merged one
        return weight
    merged = weight.clone()
    for name in adapters:
        if name in module.lora_A:
            merged += module.get_delta_weight(name).to(merged.dtype)
    return merged


def checkpoint_weights(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """``(name, tensor)`` for every weight of ``model`` as its Hugging Face checkpoint names them,
    one tensor at a time. A peft (LoRA) model yields merged weights under the base model's names, and
    no adapter tensors; only one merged weight exists at a time.

    Tied weights (``lm_head`` sharing the embedding) are yielded once, under the first name, as
    ``save_pretrained`` does.
    """
    from peft import PeftModel

    base = model.get_base_model() if isinstance(model, PeftModel) else model
    if isinstance(model, PeftModel):
        for module in base.modules():
            if getattr(module, "modules_to_save", None) is not None and hasattr(module, "original_module"):
                raise ValueError(
                    "weight sync: peft `modules_to_save` is not supported with an engine of its own; "
                    "train those modules without it (or use the `hf` rollout engine)"
                )
    lora_prefixes: set[str] = set()
    for mod_name, module in base.named_modules():
        if hasattr(module, "base_layer") and hasattr(module, "lora_A"):
            lora_prefixes.add(mod_name)
    seen: set[int] = set()
    for name, param in base.named_parameters(remove_duplicate=False):
        if ".lora_" in name or "lora_embedding" in name:
            continue
        if id(param) in seen:
            continue
        seen.add(id(param))
        prefix = name.rsplit(".", 2)[0] if ".base_layer." in name else None
        if prefix in lora_prefixes and name.endswith("base_layer.weight"):
            yield prefix + ".weight", _lora_merged(base.get_submodule(prefix))
        else:
            yield name.replace(".base_layer.", "."), param.detach()
    for name, buf in base.named_buffers():
        # Persistent buffers that checkpoints hold (rotary inv_freq is recomputed, and not saved).
        if "inv_freq" not in name:
            yield name.replace(".base_layer.", "."), buf.detach()


def is_sharded(model: nn.Module) -> bool:
    """Whether any of ``model``'s parameters is a ``DTensor`` (FSDP2, tensor parallel): walking its
    weights whole is then a collective of every rank."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def weight_buckets(
    weights: Iterable[tuple[str, Tensor]], *, max_bytes: int, dtype: torch.dtype | None = None, device: Any = None
) -> Iterator[list[tuple[str, Tensor]]]:
    """Group ``weights`` into lists of at most ``max_bytes`` (a tensor larger than that is a bucket of
    its own), cast to ``dtype``, gathered whole if sharded, and moved to ``device`` bucket by bucket.
    Only the current bucket's converted tensors are alive: the caller hands each bucket over before
    asking for the next."""
    from torch.distributed.tensor import DTensor

    bucket: list[tuple[str, Tensor]] = []
    size = 0
    for name, tensor in weights:
        nbytes = tensor.numel() * (dtype.itemsize if dtype is not None and tensor.is_floating_point() else tensor.element_size())
        if bucket and size + nbytes > max_bytes:
            yield bucket
            bucket, size = [], 0
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)  # a shard's cast: the gather below moves the smaller dtype
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        if device is not None:
            tensor = tensor.to(device)
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket
