"""Attention for packed rows under ``sdpa`` that scores each sequence alone, as a varlen kernel does.

``transformers`` isolates the sequences of a packed row (position ids restarting at 0, no attention
mask; :mod:`lightning_mem.data.packing`) under ``sdpa`` with a block-diagonal mask: the kernel
still scores every pair of the whole row, ``T^2`` per head, most of them masked, where the
sequences need ``sum L_i^2``. Measured on the 2-core CPU, that made a packed PPO update run at
0.63x the padded one's tokens/s (docs/benchmarks.md). Flash-attention varlen avoids it on a GPU;
``sdpa`` has no varlen form, so this wrapper cuts the row where the positions restart and runs
``sdpa`` once per sequence (causal, no mask).

It is registered with ``transformers``' attention registry as :data:`NAME`, with ``sdpa``'s mask
function, and :func:`use_packed_sdpa` switches a model that runs ``sdpa`` to it. Anything that is
not a packed row -- a padded batch, one sequence, generation with a KV cache -- goes to ``sdpa``
unchanged, with its mask. Finding the cuts reads the positions on the host once per layer: cheap
on CPU, a synchronisation per layer on a GPU (where ``flash_attention_2`` is the better choice).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

#: The name the wrapper is registered under (``attn_implementation`` a model switched to it reports).
NAME = "packed_sdpa"


def sequence_bounds(query: Tensor, key: Tensor, position_ids: Tensor | None) -> list[tuple[int, int]] | None:
    """``[(start, stop)]`` of the sequences of a packed row, or None when the call is not one
    (more than one row, a KV cache, no restart of the positions)."""
    if position_ids is None or query.shape[0] != 1 or position_ids.shape[0] != 1 or key.shape[2] != query.shape[2]:
        return None
    positions = position_ids[0]
    if positions.shape[0] != query.shape[2] or int(positions[0]) != 0:
        return None
    starts = (positions == 0).nonzero().flatten().tolist()
    if len(starts) < 2:
        return None
    return list(zip(starts, [*starts[1:], positions.shape[0]]))


def packed_sdpa_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                          *, position_ids: Tensor | None = None, **kwargs) -> tuple[Tensor, None]:
    """A ``transformers`` attention function (``query``/``key``/``value`` ``[B, heads, T, D]``,
    output ``[B, T, heads, D]``): ``sdpa`` per sequence on a packed row, plain ``sdpa`` otherwise."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    bounds = sequence_bounds(query, key, position_ids)
    if bounds is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    # The row's block-diagonal mask is ignored: each slice is one whole sequence, causal on its own.
    outputs = [sdpa_attention_forward(module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], None, **kwargs)[0]
               for a, b in bounds]
    return torch.cat(outputs, dim=1), None


def register_packed_sdpa() -> str:
    """Register :func:`packed_sdpa_attention` (and ``sdpa``'s mask function) as :data:`NAME`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    if NAME not in AttentionInterface():
        AttentionInterface.register(NAME, packed_sdpa_attention)
        AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return NAME


def use_packed_sdpa(model: nn.Module) -> bool:
    """Switch the ``transformers`` models in ``model`` (a causal LM, a peft model, a value model's
    backbone) that run ``sdpa`` to :data:`NAME`; True if one was switched. Other implementations
    (``eager``, flash-attention, a context-parallel wrapper) are left as they are."""
    switched = False
    for module in model.modules():
        config = getattr(module, "config", None)
        setter = getattr(module, "set_attn_implementation", None)
        if config is None or setter is None or getattr(config, "_attn_implementation", None) != "sdpa":
            continue
        setter(register_packed_sdpa())
        switched = True
    return switched
