"""Padding-free packed batches: several examples in one row of the token budget, isolated.

``data.packing: true`` puts whole examples into rows of ``max_tokens_per_batch`` tokens by
best-fit-decreasing (:func:`best_fit_decreasing`); each micro-batch is one such row, with no padding
at all. Packing done wrong fails silently (attention across boundaries, positions that run on, a
loss on the next example's first token), so a packed row is built to compute exactly what the same
examples compute one per row:

- ``position_ids`` restart at 0 for every example. There is no ``attention_mask``: from restarting
  positions ``transformers`` derives a block-diagonal causal mask under ``sdpa``/``eager``
  (``masking_utils.find_packed_sequence_indices``) and ``cu_seqlens`` for flash-attention varlen
  (``modeling_flash_attention_utils.prepare_fa_kwargs_from_position_ids``). Only without a KV
  cache: the model must run with ``use_cache=False``, as :func:`lightning_mem.logits.score_tokens`
  runs it (with a cache, transformers 5 builds a plain causal mask across the whole row).
  The block-diagonal mask still scores every pair of the row under ``sdpa``; the PPO recipe's
  packed passes therefore switch ``sdpa`` models to :mod:`lightning_mem.packed_attention`, which
  runs each sequence alone (SFT packing does not yet).
- every example's first label is ``-100``: the position before it is the previous example's last
  token, and an unpacked example never scores its first token either.

The equality with unpacked batches (loss, gradients, a token that does not move when another
example changes) is pinned by ``tests/test_packing.py``; for the RL passes (``model.ppo.packing``,
which pack right-padded rollouts with :func:`pack_right_padded`) by ``tests/rl/test_packed_passes.py``.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_mem.batching import MicroBatch, TokenBudgetSampler

IGNORE_INDEX = -100

#: Attention implementations of ``transformers`` that isolate packed sequences given restarting
#: ``position_ids`` and no attention mask (the block-diagonal mask or varlen ``cu_seqlens``).
#: None is transformers' default (``sdpa`` where torch has it, else ``eager``).
ISOLATING_ATTENTION = frozenset({None, "sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention"})


def best_fit_decreasing(indices: Sequence[int], lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of ``indices`` whose summed ``lengths`` fit ``capacity``, by best-fit-decreasing.

    The longest example goes first, each into the fullest bin it still fits (a new bin when none
    does). Ties keep the order of ``indices``, so a shuffled ``indices`` gives bins of random
    composition. An example longer than ``capacity`` gets a bin of its own rather than being lost
    (truncation is the data pipeline's job). ``O(n log n)`` plus a list insertion per example.
    """
    if capacity <= 0:
        raise ValueError(f"`capacity` must be positive, got {capacity}")
    order = sorted(indices, key=lambda i: -lengths[i])  # stable: ties keep the given order
    bins: list[list[int]] = []
    # (room left, bin number) of the bins that still have room, kept sorted: the best fit is the
    # first entry whose room is at least the example's length.
    rooms: list[tuple[int, int]] = []
    for idx in order:
        length = lengths[idx]
        at = bisect.bisect_left(rooms, (length, -1))
        if at == len(rooms):
            bins.append([idx])
            room, number = capacity - length, len(bins) - 1
        else:
            room, number = rooms.pop(at)
            bins[number].append(idx)
            room -= length
        if room > 0:
            bisect.insort(rooms, (room, number))
    return bins


class PackedBatchSampler(TokenBudgetSampler):
    """:class:`~lightning_mem.batching.TokenBudgetSampler` whose batches are packed rows: the
    examples of a batch sum to at most ``max_tokens`` (not ``longest x count``), grouped by
    best-fit-decreasing over the whole (seeded, shuffled) set, so every row mixes lengths and no
    batch is a run of similar lengths. Epochs reshuffle the rows; ranks, step weights and resume
    work as in the parent."""

    def __init__(self, lengths: Sequence[int], *, max_tokens: int, **kwargs: Any) -> None:
        if kwargs.get("batch_size") is not None:
            raise ValueError("a packed sampler fills rows of `max_tokens`; `batch_size` does not apply")
        super().__init__(lengths, max_tokens=max_tokens, **kwargs)

    def _group(self, order: list[int]) -> list[list[int]]:
        return best_fit_decreasing(order, self.lengths, self.max_tokens)

    def padding_efficiency(self) -> float:
        """Real tokens / tokens of the rows as run (a packed row is as long as its examples): 1.0."""
        real = sum(self.lengths[i] for b in self.batches for i in b)
        return real / max(real, 1)

    def fill(self) -> float:
        """Real tokens / (rows x ``max_tokens``): how full best-fit-decreasing packs the rows."""
        real = sum(self.lengths[i] for b in self.batches for i in b)
        return real / max(len(self.batches) * self.max_tokens, 1)


def collate_packed(examples: Sequence[dict[str, Sequence[int]]]) -> dict[str, torch.Tensor]:
    """One row ``[1, sum of lengths]``: ``input_ids``, ``labels`` (each example's first label
    ``-100``) and ``position_ids`` restarting at 0 per example; no ``attention_mask`` (see the
    module docstring for why its absence is what isolates the examples). Examples hold lists or
    int arrays (the Arrow cache's int32 columns)."""
    ids, labels, positions = [], [], []
    for example in examples:
        n = len(example["input_ids"])
        if not n:
            continue
        ids.append(torch.as_tensor(example["input_ids"], dtype=torch.long))
        label = torch.as_tensor(example["labels"], dtype=torch.long).clone()
        label[0] = IGNORE_INDEX
        labels.append(label)
        positions.append(torch.arange(n, dtype=torch.long))
    as_row = lambda parts: (torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)).unsqueeze(0)  # noqa: E731
    return {"input_ids": as_row(ids), "labels": as_row(labels), "position_ids": as_row(positions)}


class PackedCollator:
    # A class, not a lambda, so that DataLoader workers can pickle it.
    def __call__(self, examples: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        batch = collate_packed(examples)
        if isinstance(examples, MicroBatch) and examples.step_weight is not None:
            # The label tokens of this micro-batch's whole optimizer step, on all ranks (an int:
            # precision plugins cast floats).
            batch["step_label_tokens"] = torch.tensor(int(examples.step_weight), dtype=torch.long)
        return batch


@dataclass
class PackedRows:
    """Right-padded rows ``[N, T]`` as one packed row: ``input_ids`` and ``position_ids`` ``[1, tokens]``,
    and ``starts[i]``, where row ``i``'s first token sits in it (token ``t`` of row ``i`` is at
    ``starts[i] + t``)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    starts: torch.Tensor


def pack_right_padded(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> PackedRows:
    """The real tokens of right-padded rows (``attention_mask`` 1 on a prefix of each row) back to
    back in one row, positions restarting at 0 per row. Run it with no attention mask and
    ``use_cache=False`` (the module docstring says why that isolates the rows)."""
    lengths = attention_mask.sum(dim=1)
    keep = attention_mask.bool()
    starts = torch.cumsum(lengths, dim=0) - lengths
    # Each kept token's column is its position within its row (right padding: real tokens first).
    columns = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    return PackedRows(input_ids[keep].unsqueeze(0), columns[keep].unsqueeze(0), starts)


def largest_packed_batch(fill_token: int, max_tokens: int, max_length: int) -> dict[str, torch.Tensor]:
    """The largest packed micro-batch: one row of ``max_tokens`` tokens made of examples of
    ``max_length`` (the last one shorter if it does not divide), every token but each example's
    first a label. What the memory estimate runs the recipe on."""
    lengths = [max_length] * (max_tokens // max_length) + ([max_tokens % max_length] if max_tokens % max_length else [])
    examples = [{"input_ids": [fill_token] * n, "labels": [fill_token] * n} for n in lengths]
    batch = collate_packed(examples)
    batch["step_label_tokens"] = torch.tensor(int((batch["labels"] != IGNORE_INDEX).sum()), dtype=torch.long)
    return batch


def check_packing_attention(attn_implementation: str | None, *, key: str, packing_key: str) -> None:
    """Refuse an attention implementation that would let packed examples attend to each other."""
    if attn_implementation not in ISOLATING_ATTENTION:
        from lightning_mem.settings import SettingError

        known = ", ".join(sorted(a for a in ISOLATING_ATTENTION if a))
        raise SettingError(
            key,
            f" ({attn_implementation!r}) cannot isolate the examples of a packed row (`{packing_key}: true`):"
            f" use one of {known}, or set `{packing_key}: false`",
        )
