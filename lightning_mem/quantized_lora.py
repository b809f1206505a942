"""A 4-bit base with LoRA adapters on it, ready to train: the QLoRA recipe's model, and the DPO
recipe's when it sets ``model.quantization``.

The steps, in order: load the base with its linear layers quantized as they are read
(:func:`~lightning_mem.quantization.load_quantized_causal_lm`); freeze it, its unquantized tensors in
the frozen role's dtype (:func:`~lightning_mem.quantization.freeze_quantized_base`); checkpoint each
decoder block if asked (before the adapters: peft wraps the blocks' linear layers, not the blocks);
add the adapters (:func:`~lightning_mem.lora.apply_lora`), in train mode, in the trained dtype.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_mem.activation_checkpointing import checkpoint_blocks
from lightning_mem.dtypes import cast_trainable
from lightning_mem.lora import LoraSettings, apply_lora
from lightning_mem.quantization import QuantizationSettings, freeze_quantized_base, load_quantized_causal_lm
from lightning_mem.settings import settings_at


def load_quantized_lora(
    path: str,
    quantization: QuantizationSettings,
    lora: LoraSettings,
    *,
    frozen_dtype: torch.dtype,
    trained_dtype: torch.dtype,
    activation_checkpointing: bool = False,
    settings_key: str = "model",
    **load_kwargs: Any,
) -> nn.Module:
    """The peft model of ``path``'s 4-bit base with fresh ``lora`` adapters, the only trainable
    tensors. ``load_kwargs`` go to :func:`~lightning_mem.quantization.load_quantized_causal_lm`
    (``device_map``, ``attn_implementation``, ...); a bad one is named under ``settings_key``."""
    with settings_at(settings_key):
        base = load_quantized_causal_lm(path, quantization, **load_kwargs)
    base.config.use_cache = False  # training never reuses the KV cache
    base = freeze_quantized_base(base, frozen_dtype)
    if activation_checkpointing:
        # The library's one checkpointing primitive, per decoder block, non-reentrant: it
        # recomputes correctly even though no input of a block needs a grad (the embeddings
        # are frozen), so no hook has to force requires_grad on the inputs.
        checkpoint_blocks(base)
    # from_pretrained returns a model in eval mode; Lightning keeps modules in the mode they are
    # in, so without this the adapters' dropout would never be active.
    with settings_at(settings_key):
        model = apply_lora(base, lora).train()
    cast_trainable(model, trained_dtype)
    return model
