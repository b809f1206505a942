"""Preference data for DPO and reward models: pairs of a prompt with a chosen and a rejected
completion, tokenized once into the Arrow cache, batched by token budget (or packed), both sides of
a pair in one micro-batch.

The row shapes and the truncation rule are in :mod:`lightning_mem.data.pairs`; this module holds
the memory-mapped pair set, the micro-batch layout (one forward over ``[chosen; rejected]``) and the
:class:`PreferenceDataModule`. Its arguments are :class:`~lightning_mem.data.sft.SFTDataModule`'s,
and so are its sources, cache, sampler, resume and packing; what differs is counted in pairs.
"""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from jsonargparse.typing import PositiveInt
from torch.utils.data import DataLoader, Dataset

from lightning_mem.batching import BatchPlan, MicroBatch, TokenBudgetSampler
from lightning_mem.data import packing as packed
from lightning_mem.data.cache import (
    BLANK,
    DROPPED,
    KEPT,
    arrow_files,
    cache_key,
    code_version,
    column,
    map_rows,
    narrow_index,
    open_arrow,
    raw_rows,
    source_identity,
    take_ragged,
    take_strings,
    tokenizer_identity,
)
from lightning_mem.data.chat import encode_rendered
from lightning_mem.data.pairs import IDENTICAL, SIDES, PairStats, pair_features, tokenize_pair_batch
from lightning_mem.data.rows import DataFormatError, warn_once
from lightning_mem.data.sft import IGNORE_INDEX, SFTDataModule, collate_right_padded, span_labels, with_targets
from lightning_mem.ranks import data_parallel, per_rank_budget
from lightning_mem.settings import SettingError, check_arguments, join_key, settings_at

log = logging.getLogger(__name__)


class PreferenceDataset(Dataset):
    """Kept pairs, memory-mapped from the Arrow cache. Item ``i`` (``i`` is the pair's
    ``pair_index``: its position among the kept pairs, stable for a given cache) is
    ``{"chosen_ids", "chosen_labels", "rejected_ids", "rejected_labels"}`` (int32 arrays),
    ``"pair_index"`` and ``"margin"``; indexing with a list gives a list (for batch samplers).

    Per pair, only int32/float32 arrays read from the cache's columns are kept (row positions, each
    side's length, the chosen side's targets, the margin): 20 bytes a pair, no Python object."""

    def __init__(self, table: Any) -> None:
        self.table = table
        self.positions = narrow_index(np.flatnonzero(column(table, "status") == KEPT))
        self.chosen_lengths: np.ndarray = column(table, "chosen_length")[self.positions]
        self.rejected_lengths: np.ndarray = column(table, "rejected_length")[self.positions]
        #: Tokens each chosen side is scored on (an NLL term's denominator: ``step_chosen_tokens``).
        self.chosen_targets: np.ndarray = column(table, "chosen_targets")[self.positions]
        self.margins: np.ndarray = column(table, "margin")[self.positions]

    def __len__(self) -> int:
        return len(self.positions)

    def padded_lengths(self) -> np.ndarray:
        """Each pair's padded cost per sequence in a right-padded micro-batch, doubled: the pair
        costs ``2 x max(chosen, rejected)`` tokens, so a budget over these counts both sides."""
        return (np.maximum(self.chosen_lengths, self.rejected_lengths) * 2).astype(np.int32)

    def packed_lengths(self) -> np.ndarray:
        """Each pair's tokens back to back (chosen, then rejected): its room in a packed row."""
        return (self.chosen_lengths + self.rejected_lengths).astype(np.int32)

    def pairs(self, indices: Any) -> list[dict[str, Any]]:
        indices = np.asarray(indices, dtype=np.int64)
        rows = self.positions[indices]
        out = [{"pair_index": int(i), "margin": float(m)} for i, m in zip(indices, self.margins[indices])]
        for side in SIDES:
            for key in ("ids", "labels"):
                for pair, values in zip(out, take_ragged(self.table, rows, f"{side}_{key}")):
                    pair[f"{side}_{key}"] = values
        return out

    def __getitem__(self, idx: int | list[int]) -> Any:
        if isinstance(idx, MicroBatch):  # keeps its step's totals for the collator
            batch = MicroBatch(self.pairs(idx))
            batch.step_weight = idx.step_weight
            return batch
        if isinstance(idx, list):
            return self.pairs(idx)
        if not -len(self) <= idx < len(self):
            raise IndexError(idx)
        return self.pairs([idx % len(self)])[0]


class PairCollator:
    """A micro-batch of ``B`` pairs as ``2B`` sequences, chosen sides first (sequence ``i``) then
    rejected (``B + i``): right-padded, or packed into rows of ``row_length`` (each pair's sides back
    to back, isolated as SFT's packed examples are). Adds what the loss needs, found here on the host:
    ``target_positions``/``target_ids``/``label_tokens`` (:func:`~lightning_mem.data.sft.with_targets`),
    ``target_sequence``, ``sequence_tokens``, ``sequence_ends``, ``pair_index``, ``margin``, and on
    training batches ``step_pairs``/``step_chosen_tokens`` (see docs/data.md)."""

    # A class, not a lambda, so that DataLoader workers can pickle it.
    def __init__(self, pad_token_id: int, *, packing: bool = False, row_length: int | None = None) -> None:
        self.pad_token_id = pad_token_id
        self.packing = packing
        self.row_length = row_length

    def __call__(self, pairs: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        count = len(pairs)
        sides = [{"input_ids": p[f"{side}_ids"], "labels": p[f"{side}_labels"]} for side in SIDES for p in pairs]
        lengths = torch.tensor([len(s["input_ids"]) for s in sides], dtype=torch.long)
        if self.packing:
            # Pair i's chosen then rejected side, pair after pair: the order the sampler's rows hold.
            order = [k for i in range(count) for k in (i, count + i)]
            batch = packed.collate_packed([sides[k] for k in order], self.row_length)
            _, places = packed.packed_places([int(lengths[k]) for k in order], self.row_length)
            width = batch["input_ids"].shape[1]
            starts = torch.zeros(2 * count, dtype=torch.long)
            starts[order] = torch.tensor([row * width + at for row, at in places], dtype=torch.long)
        else:
            batch = collate_right_padded(sides, self.pad_token_id)
            starts = torch.arange(2 * count, dtype=torch.long) * batch["input_ids"].shape[1]
        batch = with_targets(batch)
        # Which sequence each flat position belongs to (-1: padding), read at the targets.
        owner = torch.full((batch["input_ids"].numel(),), -1, dtype=torch.long)
        sequence = torch.repeat_interleave(torch.arange(2 * count), lengths)
        within = torch.arange(len(sequence)) - torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
        owner[torch.repeat_interleave(starts, lengths) + within] = sequence
        batch["target_sequence"] = owner[batch["target_positions"]]
        batch["sequence_tokens"] = torch.bincount(batch["target_sequence"], minlength=2 * count)
        batch["sequence_ends"] = starts + lengths - 1
        batch["pair_index"] = torch.tensor([p["pair_index"] for p in pairs], dtype=torch.long)
        batch["margin"] = torch.tensor([p["margin"] for p in pairs], dtype=torch.float32)
        if isinstance(pairs, MicroBatch) and pairs.step_weight is not None:
            # This micro-batch's whole optimizer step, every rank: ints (precision plugins cast floats).
            step_pairs, step_chosen = pairs.step_weight  # type: ignore[misc]
            batch["step_pairs"] = torch.tensor(int(step_pairs), dtype=torch.long)
            batch["step_chosen_tokens"] = torch.tensor(int(step_chosen), dtype=torch.long)
        return batch


def flatten_pair_rows(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A packed pair micro-batch of several rows as one row of their real tokens
    (:func:`~lightning_mem.data.packing.flatten_rows`: what flash-attention's varlen path isolates),
    with ``target_positions`` and ``sequence_ends`` moved to the same tokens in it; every other key
    is unchanged (``target_sequence`` still names each target's side)."""
    flat = packed.flatten_rows(batch)
    if flat is batch:
        return batch
    width, rows = batch["input_ids"].shape[1], batch["row_tokens"]
    row_starts = torch.cumsum(rows, 0) - rows  # where each row's tokens begin in the one row
    for key in ("target_positions", "sequence_ends"):
        flat[key] = row_starts[batch[key] // width] + batch[key] % width
    return flat


class InOrderSampler(TokenBudgetSampler):
    """Micro-batches of consecutive pairs in dataset order (no shuffling, no length sorting), under
    the same budget: ``batch_size`` pairs, ``max_tokens`` padded tokens (``lengths`` are the
    pairs' padded costs), or, with ``row_length``, ``max_tokens // row_length`` packed rows filled
    next-fit (``lengths`` are the pairs' packed lengths). Over ``num_replicas`` ranks, batch ``k`` goes
    to rank ``k % num_replicas``. What a pass over every pair (the DPO reference precompute) reads."""

    def __init__(self, lengths: Any, *, row_length: int | None = None, **kwargs: Any) -> None:
        self.row_length = row_length
        super().__init__(lengths, shuffle=False, **kwargs)

    def _group(self, order: np.ndarray) -> BatchPlan:
        if self.batch_size is not None:
            return super()._group(order)
        starts: list[int] = []
        longest = count = rows = room = 0
        fit_rows = max(self.max_tokens // self.row_length, 1) if self.row_length else 0
        # A Python int per pair while this loop runs (freed after): the plan itself is two arrays.
        for at, n in enumerate(self.lengths[order].tolist()):
            if self.row_length:  # next-fit rows; a new micro-batch when its rows are full
                if count and n <= room:
                    room, count = room - n, count + 1
                    continue
                if not count or rows == fit_rows:
                    starts.append(at)
                    rows = count = 0
                rows, room, count = rows + 1, self.row_length - n, count + 1
            elif count and max(longest, n) * (count + 1) <= self.max_tokens:
                longest, count = max(longest, n), count + 1
            else:
                starts.append(at)
                longest, count = n, 1
        return BatchPlan(order, np.asarray([*starts, len(order)], dtype=np.int64))


class PreferenceDataModule(SFTDataModule):
    """Preference pairs for DPO and reward models: rows ``{prompt, chosen, rejected}`` as strings or
    conversations, or ``{chosen, rejected}`` whole conversations sharing their prompt, with an
    optional ``system`` and ``margin`` (:mod:`lightning_mem.data.pairs`; docs/data.md).

    The arguments, sources, cache, sampler, resume and packing are :class:`SFTDataModule`'s, counted
    in pairs:

    Args:
        train_file, val_file, dataset, subset, train_split, val_split, columns, num_proc, cache_dir,
            num_workers, seed, tokenizer: as :class:`SFTDataModule`'s.
        max_length: tokens of one side (prompt + that completion); each side keeps its first
            ``max_length`` tokens, so a long prompt leaves less of its completion. A pair either of
            whose sides keeps no completion token, or whose sides become identical, is dropped (both
            counted, and one warning says how many).
        batch_size: pairs per micro-batch (two sequences each), when ``max_tokens_per_batch`` is not set.
        max_tokens_per_batch: padded tokens of a micro-batch, both sides counted (a pair costs
            ``2 x max(len(chosen side), len(rejected side))``); at least ``2 x max_length``.
        packing: packed micro-batches: pairs in rows of ``2 x max_length`` tokens (the longest pair
            fits one), each pair's sides back to back, every side isolated (position ids restart, no
            attention across sides), ``max_tokens_per_batch // (2 x max_length)`` rows a micro-batch.

    Micro-batches hold ``2B`` sequences for ``B`` pairs, the chosen sides first (:class:`PairCollator`).
    """

    def __init__(
        self,
        train_file: str | None = None,
        val_file: str | None = None,
        tokenizer: str | None = None,
        max_length: PositiveInt = 1024,
        batch_size: PositiveInt | None = 8,
        max_tokens_per_batch: PositiveInt | None = None,
        num_workers: int = 0,
        seed: int = 0,
        dataset: str | None = None,
        subset: str | None = None,
        train_split: str = "train",
        val_split: str | None = None,
        columns: dict[str, str] | None = None,
        num_proc: PositiveInt = 1,
        cache_dir: str | None = None,
        packing: bool = False,
    ) -> None:
        check_arguments(PreferenceDataModule.__init__, {"max_length": max_length, "max_tokens_per_batch": max_tokens_per_batch})
        if max_tokens_per_batch is not None and max_tokens_per_batch < 2 * max_length:
            raise SettingError(
                "max_tokens_per_batch",
                f" ({max_tokens_per_batch}) is below twice `max_length` ({2 * max_length}): the longest pair"
                " (two sides of max_length tokens) would not fit a micro-batch",
                siblings=("max_length",),
            )
        super().__init__(train_file, val_file, tokenizer, max_length, batch_size, max_tokens_per_batch, num_workers,
                         seed, dataset, subset, train_split, val_split, columns, num_proc, cache_dir, packing)
        self.train_set: PreferenceDataset | None = None  # type: ignore[assignment]
        self.val_set: PreferenceDataset | None = None  # type: ignore[assignment]
        self.stats: dict[str, PairStats] = {}  # type: ignore[assignment]

    @property
    def row_length(self) -> int:
        """Tokens of a packed row: the longest pair's two sides."""
        return 2 * self.max_length

    def cache_folder(self, name: str) -> Path:
        """The cache folder of the ``"train"`` or ``"val"`` pairs under these settings."""
        parts = ["preference", source_identity(self.source, name), tokenizer_identity(self.tokenizer), self.max_length,
                 code_version(tokenize_pair_batch, encode_rendered, span_labels)]
        return self.cache_root / f"preference-{name}-{cache_key(parts)}"

    def data_identity(self, name: str = "train") -> str:
        """A name for the tokenized pairs of ``name`` that changes whenever they would (source,
        tokenizer, chat template, ``max_length``, tokenization code): the cache folder's. A cache of
        per-pair values indexed by ``pair_index`` (the DPO reference log-probs) is keyed by it."""
        with settings_at(self.config_key):
            self._load_tokenizer()
        return self.cache_folder(name).name

    def _build(self, name: str, folder: Path, key: str) -> dict[str, Any]:
        log.info(f"tokenizing {name} pairs ({self.source.describe(name)}) into {folder.parent} with {self.num_proc} process(es)")
        raw, jsonl = raw_rows(self.source, name, folder)
        meta: dict[str, Any] = {"files": [], "stats": PairStats().__dict__}
        if len(raw):
            function = partial(tokenize_pair_batch, tokenizer=self.tokenizer, max_length=self.max_length, jsonl=jsonl,
                               columns=self.source.columns)
            mapped = map_rows(raw, function, folder, num_proc=self.num_proc, features=pair_features(), key=key,
                              desc=f"tokenizing {name} pairs")
            status = column(mapped, "status")
            rows = status != BLANK
            dropped = np.flatnonzero((status == DROPPED) | (status == IDENTICAL))
            stats = PairStats(
                rows=int(rows.sum()), truncated=int(column(mapped, "truncated")[rows].sum()),
                dropped=int((status == DROPPED).sum()), identical=int((status == IDENTICAL).sum()),
                dropped_where=take_strings(mapped, dropped, "where"),
            )
            meta = {"files": arrow_files(mapped), "stats": stats.__dict__}
        del raw
        for f in folder.glob("raw-*.arrow"):
            f.unlink()
        return meta

    def _load(self, name: str) -> PreferenceDataset:  # type: ignore[override]
        where = self.source.describe(name)
        folder, meta = self._cached(name)
        stats = PairStats(**meta["stats"])
        self.stats[name] = stats
        summary = stats.summary(f"{name} ({where})", self.max_length)
        if stats.truncated or stats.dropped or stats.identical:
            warn_once(summary + f"; raise `{join_key(self.config_key, 'max_length')}` to keep whole pairs")
        else:
            log.info(summary)
        if stats.rows - stats.dropped - stats.identical <= 0:
            raise DataFormatError(f"{where}: no usable pairs after tokenization")
        return PreferenceDataset(open_arrow(folder, meta["files"]))

    def _sampler(self, dataset: PreferenceDataset, shuffle: bool, *, train: bool = False) -> TokenBudgetSampler:  # type: ignore[override]
        trainer = self.trainer
        replicas, replica = data_parallel(trainer)
        common = dict(
            # A rank of a context-parallel group holds 1/cp of each sequence: the budget is per rank.
            max_tokens=per_rank_budget(self.max_tokens_per_batch, trainer),
            # The replicas read different batches; a tensor- or context-parallel group shares one.
            num_replicas=replicas, rank=replica, shuffle=shuffle, seed=self.seed,
            # Training batches carry their optimizer step's pairs and chosen-side targets (all
            # micro-batches, all ranks): a loss that is a mean over the step's pairs (or an NLL term's
            # over its chosen tokens) then does not move with the split.
            weights=np.stack([np.ones(len(dataset)), dataset.chosen_targets], axis=1) if train else None,
            accumulate_grad_batches=trainer.accumulate_grad_batches if train and trainer else 1,
        )
        if self.packing:
            return packed.PackedBatchSampler(dataset.packed_lengths(), row_length=self.row_length, **common)
        return TokenBudgetSampler(dataset.padded_lengths(), batch_size=self.batch_size, **common)

    def _collator(self) -> PairCollator:
        return PairCollator(self.tokenizer.pad_token_id, packing=self.packing, row_length=self.row_length)

    def _loader(self, dataset: PreferenceDataset, sampler: TokenBudgetSampler) -> DataLoader:  # type: ignore[override]
        return DataLoader(dataset, sampler=sampler, batch_size=None, collate_fn=self._collator(), num_workers=self.num_workers)

    def reference_loader(self, name: str = "train", *, num_replicas: int = 1, rank: int = 0) -> DataLoader:
        """Every kept pair of ``name`` once, in dataset order (micro-batch ``k`` to rank ``k %
        num_replicas``), under the training budget and layout, without step totals: a pass that fills
        a per-pair cache by ``pair_index`` (the DPO reference log-probs). Call :meth:`setup` first."""
        dataset = self.train_set if name == "train" else self.val_set
        assert dataset is not None, "call setup() first"
        lengths = dataset.packed_lengths() if self.packing else dataset.padded_lengths()
        sampler = InOrderSampler(lengths, row_length=self.row_length if self.packing else None,
                                 max_tokens=self.max_tokens_per_batch, batch_size=self.batch_size,
                                 num_replicas=num_replicas, rank=rank)
        return self._loader(dataset, sampler)

    def largest_batch(self, fill_token: int, context_parallel_size: int = 1) -> dict[str, torch.Tensor]:
        """The largest training micro-batch these settings allow, made of ``fill_token``: as many
        pairs as the budget (or ``batch_size``) takes, every side ``max_length`` tokens, every token
        after a side's first a label, in :class:`PairCollator`'s layout with ``step_pairs`` and
        ``step_chosen_tokens`` of this micro-batch alone; packed: ``max_tokens_per_batch // (2 x
        max_length)`` rows of one pair each. The memory estimate runs the recipe on it."""
        side = np.full(self.max_length, fill_token, dtype=np.int32)
        labels = side.copy()
        labels[0] = IGNORE_INDEX
        if self.packing:
            count = max(self.max_tokens_per_batch // self.row_length, 1)
        else:
            budget = self.max_tokens_per_batch and self.max_tokens_per_batch * context_parallel_size
            count = max(budget // self.row_length if budget else self.batch_size, 1)
        pair = {"chosen_ids": side, "chosen_labels": labels, "rejected_ids": side, "rejected_labels": labels, "margin": 0.0}
        pairs = MicroBatch({**pair, "pair_index": i} for i in range(count))
        pairs.step_weight = (count, count * (self.max_length - 1))
        return PairCollator(int(fill_token), packing=self.packing, row_length=self.row_length)(pairs)
