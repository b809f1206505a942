"""Packed batches: whole examples back to back in rows, isolated from each other.

``data.packing: true`` puts whole examples into rows of ``max_length`` tokens by best-fit-decreasing
(:func:`best_fit_decreasing`) over the whole shuffled set, and a micro-batch takes as many rows as
``max_tokens_per_batch`` holds (``max_tokens_per_batch // max_length``): the rows are full but for
a few tokens at their ends, and the data order is random, not length-sorted.

Why rows of ``max_length`` and not one row of the whole budget: under ``sdpa``/``eager`` the
examples of a row are isolated by a block-diagonal mask *over the whole row*, so attention costs
(row length)^2 in time and in its ``[heads, row, row]`` weights. Rows no longer than a padded batch's
rows keep that cost where padding had it (measured: ``benchmarks/packing.py``, docs/benchmarks.md).
flash-attention's varlen kernel costs only the examples' own lengths but isolates examples of one
row only (transformers derives ``cu_seqlens`` from the position ids of a batch of one row), so under
``flash_attention_*`` a micro-batch's rows are concatenated into one (:func:`flatten_rows`), which
the recipes do before the forward.

Packing done wrong fails silently (attention across boundaries, positions that run on, a
loss on the next example's first token), so a packed row is built to compute exactly what the same
examples compute one per row:

- ``position_ids`` restart at 0 for every example. There is no ``attention_mask``: from restarting
  positions ``transformers`` derives a block-diagonal causal mask under ``sdpa``/``eager``
  (``masking_utils.find_packed_sequence_indices``) and ``cu_seqlens`` for flash-attention varlen
  (``modeling_flash_attention_utils.prepare_fa_kwargs_from_position_ids``). Only without a KV
  cache: the model must run with ``use_cache=False``, as :func:`lightning_mem.logits.score_tokens`
  runs it (with a cache, transformers 5 builds a plain causal mask across the whole row).
  The block-diagonal mask still scores every pair of the row under ``sdpa``: SFT keeps rows to
  ``max_length`` (above); the PPO recipe's packed passes, one row a micro-batch, switch ``sdpa``
  models to :mod:`lightning_mem.packed_attention`, which runs each sequence alone.
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
    """:class:`~lightning_mem.batching.TokenBudgetSampler` whose batches are packed rows: examples
    put into rows of ``row_length`` tokens (default: ``max_tokens``, one row a micro-batch) by
    best-fit-decreasing over the whole (seeded, shuffled) set, so every row mixes lengths and no
    batch is a run of similar lengths; a micro-batch is ``max_tokens // row_length`` consecutive
    rows, its indices listed row after row (:func:`collate_packed` splits them into the same rows or
    fewer). Epochs reshuffle the micro-batches; ranks, step weights and resume work as in the parent."""

    def __init__(self, lengths: Sequence[int], *, max_tokens: int, row_length: int | None = None,
                 **kwargs: Any) -> None:
        if kwargs.get("batch_size") is not None:
            raise ValueError("a packed sampler fills rows of `max_tokens`; `batch_size` does not apply")
        self.row_length = min(row_length or max_tokens, max_tokens)
        self.rows_per_batch = max(max_tokens // self.row_length, 1)
        super().__init__(lengths, max_tokens=max_tokens, **kwargs)

    def _group(self, order: list[int]) -> list[list[int]]:
        rows = best_fit_decreasing(order, self.lengths, self.row_length)
        step = self.rows_per_batch
        return [[i for row in rows[at : at + step] for i in row] for at in range(0, len(rows), step)]

    def padding_efficiency(self) -> float:
        """Real tokens / tokens of the micro-batches as collated (rows padded to their batch's
        longest row)."""
        real = padded = 0
        for batch in self.batches:
            rows = next_fit_rows([int(self.lengths[i]) for i in batch], self.row_length)
            real += sum(rows)
            padded += len(rows) * max(rows, default=0)
        return real / max(padded, 1)

    def fill(self) -> float:
        """Real tokens / (rows x ``row_length``): how full best-fit-decreasing packs the rows."""
        real = sum(int(self.lengths[i]) for b in self.batches for i in b)
        rows = sum(len(next_fit_rows([int(self.lengths[i]) for i in b], self.row_length)) for b in self.batches)
        return real / max(rows * self.row_length, 1)


def next_fit_rows(lengths: Sequence[int], row_length: int | None) -> list[int]:
    """The summed lengths of the rows that consecutive examples of ``lengths`` fill, a new row
    whenever the next example does not fit ``row_length`` (``None``: one row).

    On a micro-batch listed row after row by :class:`PackedBatchSampler` this gives its rows or
    fewer: a row is started at most once within each of the sampler's rows, since the rest of that
    row fits a row of its own."""
    if row_length is None:
        return [sum(lengths)] if lengths else []
    rows: list[int] = []
    for n in lengths:
        if rows and rows[-1] + n <= row_length:
            rows[-1] += n
        else:
            rows.append(n)
    return rows


def packed_places(lengths: Sequence[int], row_length: int | None) -> tuple[list[int], list[tuple[int, int]]]:
    """Where :func:`collate_packed` puts consecutive examples of ``lengths``: the rows' summed
    lengths (:func:`next_fit_rows`) and each example's ``(row, first column)``."""
    sizes = next_fit_rows(lengths, row_length)
    places, row, at = [], 0, 0
    for n in lengths:
        if at + n > sizes[row]:
            row, at = row + 1, 0
        places.append((row, at))
        at += n
    return sizes, places


def collate_packed(examples: Sequence[dict[str, Sequence[int]]], row_length: int | None = None) -> dict[str, torch.Tensor]:
    """Rows ``[rows, longest row]`` of consecutive examples (:func:`next_fit_rows`; one row when
    ``row_length`` is ``None``): ``input_ids``, ``labels`` (each example's first label ``-100``) and
    ``position_ids`` restarting at 0 per example; no ``attention_mask`` (see the module docstring for
    why its absence is what isolates the examples). A row shorter than the longest ends in padding:
    token 0, label ``-100``, positions restarting at 0 (a segment of its own, which no real token
    attends to: it comes after them). ``row_tokens`` holds each row's real tokens. Examples hold
    lists or int arrays (the Arrow cache's int32 columns)."""
    examples = [e for e in examples if len(e["input_ids"])]
    sizes, places = packed_places([len(e["input_ids"]) for e in examples], row_length)
    width = max(sizes, default=0)
    ids = torch.zeros(max(len(sizes), 1), width, dtype=torch.long)
    labels = torch.full_like(ids, IGNORE_INDEX)
    positions = torch.zeros_like(ids)
    for example, (row, at) in zip(examples, places):
        n = len(example["input_ids"])
        ids[row, at : at + n] = torch.as_tensor(example["input_ids"], dtype=torch.long)
        labels[row, at + 1 : at + n] = torch.as_tensor(example["labels"], dtype=torch.long)[1:]
        positions[row, at : at + n] = torch.arange(n)
    for r, size in enumerate(sizes):
        positions[r, size:] = torch.arange(width - size)
    return {"input_ids": ids, "labels": labels, "position_ids": positions,
            "row_tokens": torch.tensor(sizes or [0], dtype=torch.long)}


def flatten_rows(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A packed micro-batch of several rows as one row of their real tokens (padding dropped): what
    flash-attention's varlen path isolates (it reads ``cu_seqlens`` from a batch of one row). The
    loss and gradients are those of the rows: the same examples, positions and labels."""
    rows = batch.get("row_tokens")
    if rows is None or batch["input_ids"].shape[0] == 1:
        return batch
    flat = dict(batch)
    for key in ("input_ids", "labels", "position_ids"):
        flat[key] = torch.cat([batch[key][r, :n] for r, n in enumerate(rows.tolist())]).unsqueeze(0)
    flat["row_tokens"] = rows.sum().reshape(1)
    return flat


#: Attention implementations whose packed rows must be one row a micro-batch (see the module).
VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3")


class PackedCollator:
    """:func:`collate_packed` with rows of ``row_length``; adds the step's label tokens."""

    # A class, not a lambda, so that DataLoader workers can pickle it.
    def __init__(self, row_length: int | None = None) -> None:
        self.row_length = row_length

    def __call__(self, examples: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        batch = collate_packed(examples, self.row_length)
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
    """The largest packed micro-batch: ``max_tokens // max_length`` full rows of ``max_length``
    (one row of ``max_tokens`` when the budget is shorter than ``max_length``), each one example,
    every token but its first a label. What the memory estimate runs the recipe on."""
    row = min(max_length, max_tokens)
    examples = [{"input_ids": [fill_token] * row, "labels": [fill_token] * row}] * max(max_tokens // row, 1)
    batch = collate_packed(examples, row)
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
