"""Context parallelism: one sequence's tokens split over a group of ranks (Ulysses).

Long sequences (the 8k-32k-token responses of reasoning RL) make the activations, not the weights,
decide whether a step fits: they grow with the sequence, while FSDP divides only the weights. With a
context-parallel group of ``cp`` ranks, every rank of the group holds the same batch but runs the
model on ``1/cp`` of each sequence (a contiguous slice, with its global position ids), so every
activation it keeps for backward is ``1/cp`` of the whole.

Only attention mixes tokens. Around the attention kernel, an all-to-all trades the split: before it,
each rank holds all heads of its slice; after it, ``1/cp`` of the heads over the whole sequence, so
the kernel (SDPA, flash attention) runs unchanged, causal over the whole sequence; a second
all-to-all trades back (DeepSpeed-Ulysses, Jacobs et al. 2023; the scheme verl and DeepSpeed's
``UlyssesSPAttentionHF`` apply to Hugging Face models). It is registered in ``transformers``'
attention registry (``AttentionInterface``) as ``ulysses_<kernel>`` and the model switched to it: a
forward given no :class:`SequenceLayout` (``generate``, a reward model) is the plain kernel.

The split is the caller's: :func:`shard_sequences` gives a rank its slice of a right-padded batch
(padded to a multiple of the group, pad tokens never scored) and the scorers gather per-token results
back with :func:`gather_scattered`/:func:`gather_sequence`, so every rank of the group ends with the
whole batch's per-token values and no rank ever holds the whole sequence's activations or
``[tokens, vocab]`` logits. Those gathers' backward keeps this rank's part of the (replicated)
gradient, times ``cp``: FSDP averages gradients over the data *and* context ranks, and the tokens of
one sequence are split over the context ranks, so each rank's share must count ``cp`` times for the
average to be the data-parallel mean.

:class:`SequenceLayout` is what a strategy attaches to a model it splits (:func:`attach_layout`):
the context group, and the multiple a split slice's length must have (tensor-parallel size under
sequence parallelism, which splits the slice again).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

_ATTRIBUTE = "lightning_mem_sequence_layout"


@dataclass(frozen=True)
class SequenceLayout:
    """How a model's forward may split its sequence.

    Args:
        group: the context-parallel process group (None: no context parallelism).
        size, rank: of this rank in ``group``.
        multiple: a slice's length must divide by it (the tensor-parallel size when sequence
            parallelism splits each slice again; else 1).
    """

    group: Any = None
    size: int = 1
    rank: int = 0
    multiple: int = 1

    @property
    def context_parallel(self) -> bool:
        return self.size > 1

    def padded_length(self, length: int) -> int:
        """The sequence length a batch is padded to: a multiple of ``size x multiple``."""
        unit = self.size * self.multiple
        return -(-length // unit) * unit


def attach_layout(model: nn.Module, layout: SequenceLayout) -> None:
    """Record ``layout`` on ``model`` (a ``transformers`` model the strategy split) and, with
    context parallelism, switch its attention to the Ulysses wrapper of its current kernel."""
    setattr(model, _ATTRIBUTE, layout)
    if layout.context_parallel:
        config = model.config
        current = getattr(config, "_attn_implementation", None) or "sdpa"
        if not current.startswith("ulysses_"):
            model.set_attn_implementation(register_ulysses(current))


def layout_of(model: nn.Module) -> SequenceLayout | None:
    """The :class:`SequenceLayout` a strategy attached to ``model`` or a module inside it (a peft
    model's base, a value model's backbone); None if none."""
    for module in model.modules():
        layout = getattr(module, _ATTRIBUTE, None)
        if layout is not None:
            return layout
    return None


# ---------------------------------------------------------------------------------------------
# Splitting a batch, gathering results
# ---------------------------------------------------------------------------------------------


@dataclass
class SequenceShard:
    """This rank's slice of a right-padded ``[B, T]`` batch: ``input_ids[:, start:stop]`` of the
    batch padded to ``width`` columns, with its global ``position_ids``."""

    input_ids: Tensor
    position_ids: Tensor
    start: int
    stop: int
    width: int  # padded sequence length (every rank's slice together)
    length: int  # the batch's own length, before padding

    def owners(self, positions: Tensor, batch_width: int) -> Tensor:
        """The context rank whose slice holds each flat position ``b * batch_width + t``."""
        return (positions % batch_width) // (self.stop - self.start)

    def local_positions(self, positions: Tensor, batch_width: int) -> Tensor:
        """Flat indices into this rank's ``[B, stop - start]`` slice of the positions it holds
        (those whose :meth:`owners` is this rank), in the given order."""
        cols = positions % batch_width
        mine = (cols >= self.start) & (cols < self.stop)
        rows, cols = positions[mine] // batch_width, cols[mine]
        return rows * (self.stop - self.start) + cols - self.start


def shard_sequences(input_ids: Tensor, attention_mask: Tensor | None, layout: SequenceLayout,
                    *, pad_token_id: int = 0) -> SequenceShard:
    """This rank's slice of a right-padded batch, padded to :meth:`SequenceLayout.padded_length`.

    Raises:
        ValueError: with context parallelism, ``attention_mask`` is not right-padded. The split model attends causally over
            the whole sequence with no padding mask (the kernel sees the whole sequence only after
            the all-to-all), which leaves every real token of a right-padded row exact.
    """
    if layout.context_parallel and attention_mask is not None and attention_mask.shape[1] > 1 and bool(
        (attention_mask[:, 1:] > attention_mask[:, :-1]).any()
    ):
        raise ValueError(
            "context parallelism needs right-padded sequences (real tokens first, padding after): this batch has"
            " padding before a real token"
        )
    length = input_ids.shape[1]
    width = layout.padded_length(length)
    if width > length:
        input_ids = torch.nn.functional.pad(input_ids, (0, width - length), value=pad_token_id)
    chunk = width // layout.size
    start, stop = layout.rank * chunk, (layout.rank + 1) * chunk
    positions = torch.arange(start, stop, device=input_ids.device).unsqueeze(0).expand(input_ids.shape[0], -1)
    return SequenceShard(input_ids[:, start:stop].contiguous(), positions, start, stop, width, length)


class _GatherScattered(torch.autograd.Function):
    """Forward: every rank's values at the positions it owns, back in the positions' order.
    Backward: this rank's entries of the (replicated) gradient, times the group size."""

    @staticmethod
    def forward(ctx: Any, local: Tensor, owners: Tensor, layout: SequenceLayout) -> Tensor:
        ctx.owners, ctx.layout = owners, layout
        counts = torch.bincount(owners, minlength=layout.size).tolist()
        padded = local.new_zeros((max(counts), *local.shape[1:]))
        padded[: local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in range(layout.size)]
        dist.all_gather(parts, padded.contiguous(), group=layout.group)
        out = local.new_empty((owners.numel(), *local.shape[1:]))
        for rank, (part, count) in enumerate(zip(parts, counts)):
            out[owners == rank] = part[:count]
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return grad[ctx.owners == ctx.layout.rank] * ctx.layout.size, None, None


def gather_scattered(local: Tensor | None, owners: Tensor, layout: SequenceLayout) -> Tensor | None:
    """``[n, ...]`` values of every rank of the context group, where ``local`` holds this rank's
    values at the positions ``owners`` assigns to it (in order). Called on every rank."""
    if local is None:
        return None
    return _GatherScattered.apply(local, owners, layout)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, local: Tensor, layout: SequenceLayout) -> Tensor:
        ctx.layout = layout
        parts = [torch.empty_like(local) for _ in range(layout.size)]
        dist.all_gather(parts, local.contiguous(), group=layout.group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        layout = ctx.layout
        return grad.chunk(layout.size, dim=1)[layout.rank] * layout.size, None


def gather_sequence(local: Tensor, layout: SequenceLayout) -> Tensor:
    """``[B, width, ...]``: every rank's ``[B, slice, ...]`` along the sequence (see the module
    docstring for the backward's factor)."""
    return _GatherSequence.apply(local, layout)


def sequence_forward(forward: Any, input_ids: Tensor, attention_mask: Tensor, layout: SequenceLayout | None) -> Tensor:
    """``forward(input_ids=..., attention_mask=..., **kwargs)`` -> per-position ``[B, t, ...]``,
    run the way ``layout`` splits sequences and returned for the whole ``[B, T, ...]`` batch on
    every rank (a value model's per-token values, say). Without a layout, ``forward`` as it is."""
    if layout is None:
        return forward(input_ids=input_ids, attention_mask=attention_mask)
    shard = shard_sequences(input_ids, attention_mask, layout)
    if layout.context_parallel:
        out = forward(input_ids=shard.input_ids, attention_mask=None, position_ids=shard.position_ids,
                      sequence_layout=layout)
        out = gather_sequence(out, layout)
    else:  # sequence parallelism only: the whole sequence, padded to a multiple of the group
        mask = torch.nn.functional.pad(attention_mask, (0, shard.width - shard.length))
        out = forward(input_ids=shard.input_ids, attention_mask=mask, position_ids=shard.position_ids)
    return out[:, : shard.length]


# ---------------------------------------------------------------------------------------------
# Ulysses attention
# ---------------------------------------------------------------------------------------------


def _all_to_all(x: Tensor, layout: SequenceLayout, scatter_dim: int, gather_dim: int) -> Tensor:
    """Split ``x`` along ``scatter_dim`` into one part per rank, send part ``r`` to rank ``r``, and
    join what each rank sent along ``gather_dim`` in rank order (differentiable: the backward is
    the reverse exchange)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    send = torch.stack(x.chunk(layout.size, dim=scatter_dim)).contiguous()
    received = wait_tensor(all_to_all_single_autograd(send, None, None, layout.group))
    return torch.cat(received.unbind(0), dim=gather_dim)


#: Keyword arguments the kernel may take; the rest (position ids, cache positions) describe this
#: rank's slice, not the whole sequence the kernel sees.
KERNEL_KWARGS = ("dropout", "scaling", "softcap", "s_aux")


def ulysses_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                      *, kernel: str, sequence_layout: SequenceLayout | None = None, **kwargs: Any) -> tuple[Tensor, None]:
    """A ``transformers`` attention function: ``query``/``key``/``value`` ``[B, heads, slice, D]``
    in, ``[B, slice, heads, D]`` out. Without ``sequence_layout`` (or with a group of one) it is
    the ``kernel`` itself."""
    from transformers import AttentionInterface

    inner = AttentionInterface()[kernel]
    if sequence_layout is None or not sequence_layout.context_parallel:
        return inner(module, query, key, value, attention_mask, **kwargs)
    q, k, v = (_all_to_all(t, sequence_layout, scatter_dim=1, gather_dim=2) for t in (query, key, value))
    kernel_kwargs = {name: kwargs[name] for name in KERNEL_KWARGS if name in kwargs}
    out, _ = inner(module, q, k, v, None, is_causal=True, **kernel_kwargs)  # [B, T, heads/cp, D]
    return _all_to_all(out, sequence_layout, scatter_dim=1, gather_dim=2), None


def register_ulysses(kernel: str) -> str:
    """Register the Ulysses wrapper of attention ``kernel`` (``sdpa``, ``flash_attention_2``...;
    ``eager`` becomes ``sdpa``, the same computation) with ``transformers``, with the kernel's own
    mask function; returns its name, ``ulysses_<kernel>``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    kernel = "sdpa" if kernel == "eager" else kernel
    if kernel not in AttentionInterface():
        raise ValueError(f"context parallelism cannot wrap the attention implementation {kernel!r}")
    name = f"ulysses_{kernel}"
    if name not in AttentionInterface():
        AttentionInterface.register(name, partial(ulysses_attention, kernel=kernel))
        # The mask the kernel wants when the wrapper is the kernel itself (generation).
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[kernel])
    return name
