"""SFT data: conversations tokenized with the loss masked to the assistant's tokens, truncated,
and batched by token budget; the :class:`SFTDataModule` the SFT and QLoRA recipes train on."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from jsonargparse.typing import PositiveInt
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset

from lightning_mem.batching import MicroBatch, TokenBudgetSampler, resume_where_stopped
from lightning_mem.data.cache import (
    BLANK,
    DROPPED,
    KEPT,
    arrow_files,
    build_once,
    cache_key,
    code_version,
    column,
    default_cache_root,
    map_rows,
    narrow_index,
    open_arrow,
    parse_rows,
    raw_rows,
    source_identity,
    take_ragged,
    take_strings,
    tokenizer_identity,
)
from lightning_mem.data import packing as packed
from lightning_mem.data.chat import encode_rendered, render_with_spans, row_to_conversation
from lightning_mem.data.rows import DataFormatError, data_source, warn_once
from lightning_mem.logits import next_token_targets
from lightning_mem.padding import pad_sequences
from lightning_mem.ranks import data_parallel, per_rank_budget
from lightning_mem.settings import SettingError, check_arguments, join_key, settings_at

log = logging.getLogger(__name__)

IGNORE_INDEX = -100


@dataclass
class TokenizeStats:
    """What truncation did to a dataset: logged so that a silent cut never surprises anyone."""

    rows: int = 0
    truncated: int = 0
    dropped: int = 0
    dropped_where: list[str] = field(default_factory=list)

    def summary(self, name: str, max_length: int) -> str:
        return (
            f"{name}: {self.rows} rows, {self.truncated} truncated to max_length={max_length}, "
            f"{self.dropped} dropped (no completion token left after truncation)"
        )


def tokenize_example(
    messages: list[dict[str, str]], tokenizer: Any, max_length: int, first: int = 0
) -> tuple[dict[str, list[int]] | None, bool]:
    """Token ids and labels (-100 outside the assistant spans from ``messages[first]`` on),
    truncated to ``max_length``.

    Returns ``(example or None if nothing is left to learn, was_truncated)``.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError("a fast (Rust) tokenizer is required: loss masking uses its offset mapping")
    text, spans = render_with_spans(messages, tokenizer, first)
    enc = encode_rendered(text, tokenizer, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    labels = [
        tok if any(s <= start < e for s, e in spans) and end > start else IGNORE_INDEX
        for tok, (start, end) in zip(ids, offsets)
    ]
    truncated = len(ids) > max_length
    ids, labels = ids[:max_length], labels[:max_length]
    if all(label == IGNORE_INDEX for label in labels):
        return None, truncated
    return {"input_ids": ids, "labels": labels}, truncated


def tokenize_rows(
    rows: Sequence[dict[str, Any]], tokenizer: Any, max_length: int
) -> tuple[list[dict[str, list[int]]], TokenizeStats]:
    stats = TokenizeStats()
    examples = []
    for row in rows:
        stats.rows += 1
        messages, first = row_to_conversation(row)
        example, truncated = tokenize_example(messages, tokenizer, max_length, first)
        stats.truncated += truncated
        if example is None:
            stats.dropped += 1
            stats.dropped_where.append(row.get("_where", "?"))
            continue
        examples.append(example)
    return examples, stats


def span_labels(ids: Any, offsets: Any, spans: list[tuple[int, int]]) -> np.ndarray:
    # tokenize_example's rule on arrays: a token is learned when it starts inside an assistant
    # span and covers at least one character.
    offsets = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    start, end = offsets[:, 0], offsets[:, 1]
    inside = np.zeros(len(start), dtype=bool)
    for s, e in spans:
        inside |= (start >= s) & (start < e)
    inside &= end > start
    return np.where(inside, np.asarray(ids, dtype=np.int32), IGNORE_INDEX).astype(np.int32)


def tokenize_batch(
    batch: dict[str, list[Any]], indices: list[int], *, tokenizer: Any, max_length: int, jsonl: str, columns: dict[str, str] | None
) -> dict[str, list[Any]]:
    """``datasets.map`` function: raw rows (:func:`~lightning_mem.data.cache.raw_rows`) to the
    cached columns, one output row per input row (the same tokens as :func:`tokenize_example`).

    ``status`` marks rows with nothing left to learn and blank lines, so that the counts and the
    rows' names come from the columns afterwards, whatever process tokenized them."""
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError("a fast (Rust) tokenizer is required: loss masking uses its offset mapping")
    rows = parse_rows(batch["line"], indices, jsonl, columns)
    texts, spans, wheres = [], [], []
    for row in rows:
        if row is not None:
            messages, first = row_to_conversation(row)
            text, row_spans = render_with_spans(messages, tokenizer, first)
            texts.append(text)
            spans.append(row_spans)
            wheres.append(row["_where"])
    encoded = encode_rendered(texts, tokenizer, return_offsets_mapping=True) if texts else {"input_ids": [], "offset_mapping": []}
    out: dict[str, list[Any]] = {k: [] for k in ("input_ids", "labels", "length", "label_tokens", "truncated", "status", "where")}
    done = iter(zip(encoded["input_ids"], encoded["offset_mapping"], spans, wheres))
    empty = np.zeros(0, dtype=np.int32)
    for row in rows:
        if row is None:
            values = (empty, empty, 0, 0, False, BLANK, "")
        else:
            ids, offsets, row_spans, where = next(done)
            labels = span_labels(ids, offsets, row_spans)[:max_length]
            ids = np.asarray(ids[:max_length], dtype=np.int32)
            learned = int((labels[1:] != IGNORE_INDEX).sum())
            status = DROPPED if not (labels != IGNORE_INDEX).any() else KEPT
            values = (ids, labels, len(ids), learned, len(offsets) > max_length, status, where)
        for k, v in zip(out, values):
            out[k].append(v)
    return out


def _features() -> Any:
    import datasets

    ids = datasets.List(datasets.Value("int32"))
    return datasets.Features(
        {"input_ids": ids, "labels": ids, "length": datasets.Value("int32"), "label_tokens": datasets.Value("int32"),
         "truncated": datasets.Value("bool"), "status": datasets.Value("int8"), "where": datasets.Value("string")}
    )


class TokenizedDataset(Dataset):
    """Tokenized examples, memory-mapped from the Arrow cache; indexing with a list returns a list
    (for batch samplers). Each example is ``{"input_ids", "labels"}``, int32 numpy arrays.

    ``lengths`` and ``label_tokens`` are int32 arrays (one entry per example) read from the cache's
    columns: a sampler plans a million rows without a Python object per row.
    """

    def __init__(self, table: Any) -> None:
        self.table = table
        status = column(table, "status")
        #: Positions of the kept examples in the cached table (dropped rows and blank lines stay
        #: in it, so that nothing had to be rewritten to drop them).
        # int32 (4 bytes a row) while the table's rows fit it: a private array in every rank.
        self.positions = narrow_index(np.flatnonzero(status == KEPT))
        self.lengths: np.ndarray = column(table, "length")[self.positions]
        #: Tokens each example is scored on: labels that a previous position predicts (the first
        #: token is never a target).
        self.label_tokens: np.ndarray = column(table, "label_tokens")[self.positions]

    def __len__(self) -> int:
        return len(self.positions)

    def examples(self, indices: Any) -> list[dict[str, np.ndarray]]:
        rows = self.positions[np.asarray(indices, dtype=np.int64)]
        ids, labels = take_ragged(self.table, rows, "input_ids"), take_ragged(self.table, rows, "labels")
        return [{"input_ids": i, "labels": lab} for i, lab in zip(ids, labels)]

    def __getitem__(self, idx: int | list[int]) -> Any:
        if isinstance(idx, MicroBatch):  # keeps its step's label-token total for the collator
            batch = MicroBatch(self.examples(idx))
            batch.step_weight = idx.step_weight
            return batch
        if isinstance(idx, list):
            return self.examples(idx)
        if not -len(self) <= idx < len(self):
            raise IndexError(idx)
        return self.examples([idx % len(self)])[0]


def collate_right_padded(examples: list[dict[str, list[int]]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Pad on the right: ``input_ids`` with pad, ``labels`` with -100, and an attention mask."""
    input_ids, attention_mask = pad_sequences([e["input_ids"] for e in examples], pad_token_id)
    labels, _ = pad_sequences([e["labels"] for e in examples], IGNORE_INDEX)
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


def with_targets(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``batch`` plus what the loss needs to know about its labels, found here on the host (where it
    costs no device sync) rather than in the training step: ``target_positions`` and ``target_ids``
    (:func:`lightning_mem.logits.next_token_targets` of ``input_ids`` and ``labels``: the flat positions
    that predict a label and the labels they predict) and ``label_tokens``, their count. They travel
    to the device with the batch."""
    positions, targets = next_token_targets(batch["input_ids"], batch["labels"], IGNORE_INDEX)
    return {**batch, "target_positions": positions, "target_ids": targets,
            "label_tokens": torch.tensor(targets.numel(), dtype=torch.long)}


class _Collator:
    """Right-padded rows, or packed rows with ``row_length`` (:mod:`lightning_mem.data.packing`), with
    their targets (:func:`with_targets`) and the step's label tokens."""

    # A class, not a lambda, so that DataLoader workers can pickle it.
    def __init__(self, pad_token_id: int, *, packing: bool = False, row_length: int | None = None) -> None:
        self.pad_token_id = pad_token_id
        self.packed = packed.PackedCollator(row_length) if packing else None

    def __call__(self, examples: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        if self.packed is not None:
            return with_targets(self.packed(examples))  # it adds the step's label tokens itself
        batch = collate_right_padded(examples, self.pad_token_id)
        if isinstance(examples, MicroBatch) and examples.step_weight is not None:
            # The label tokens of this micro-batch's whole optimizer step, on all ranks.
            batch["step_label_tokens"] = torch.tensor(int(examples.step_weight), dtype=torch.long)  # an int: precision plugins cast floats
        return with_targets(batch)


class SFTDataModule(LightningDataModule):
    """Instruction-tuning data for a causal LM.

    Rows are ``{"messages": [...]}`` (the loss covers every assistant turn) or ``{"prompt": ...,
    "completion": ...}`` with strings or, as in TRL's conversational format, lists of messages (the
    loss covers the completion's assistant turns). Rows of both shapes may share a file.

    Args:
        train_file: a JSONL, JSON or Parquet file, or a folder written by ``datasets``'
            ``save_to_disk`` (of a DatasetDict, ``train_split`` is used). Exclusive with ``dataset``.
        val_file: optional, the same kinds (of a DatasetDict folder, ``val_split`` is used).
        tokenizer: model folder or hub id to load the tokenizer from (the CLI links it to
            ``model.name_or_path``).
        max_length: tokens per sample; longer rows are truncated, and rows with no completion token
            left are dropped (both counted, and a warning says how many).
        batch_size: samples per micro-batch, when ``max_tokens_per_batch`` is not set.
        max_tokens_per_batch: pack micro-batches up to this many padded tokens instead.
        seed: shuffling seed; each epoch reshuffles deterministically from it.
        dataset: a Hugging Face hub dataset id, loaded with
            ``datasets.load_dataset(dataset, name=subset, split=train_split)`` (cached by ``datasets``).
        subset: the hub dataset's configuration name, if it has several.
        train_split: the split to train on (``"train"``; slices such as ``"train[:1000]"`` work on
            the hub).
        val_split: the validation split of ``dataset`` or of a DatasetDict folder; None: no validation
            unless ``val_file`` is set.
        columns: field names of the dataset for the ones read here, e.g. ``{prompt: question,
            completion: answer}``; other fields ride along.
        num_proc: processes that tokenize when the cache is built (``datasets.map``'s ``num_proc``).
        cache_dir: where tokenized sets are cached (a folder per data, tokenizer, chat template,
            ``max_length`` and tokenization code); None: ``.lightning_mem_cache`` next to
            ``train_file`` (see :func:`~lightning_mem.data.cache.default_cache_root`).
        packing: packed batches: whole examples in rows of ``max_length`` tokens
            (best-fit-decreasing over the shuffled set, random order), ``max_tokens_per_batch //
            max_length`` rows a micro-batch, position ids restarting per example, no attention
            across examples (:mod:`lightning_mem.data.packing`); the loss and gradients equal the
            unpacked ones.

    Tokenization runs once, on the first start: Lightning's ``prepare_data`` (local rank 0)
    builds the cache, every rank memory-maps it in ``setup``; later starts and resumes reuse it.

    Errors name the arguments (``max_length``), under :attr:`config_key` when it is set.
    """

    #: Where a config holds this module's arguments (the recipes' CLI sets ``"data"``), so that
    #: errors raised while reading name ``data.train_split``; empty: the argument alone.
    config_key: str = ""

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
        super().__init__()
        # Cheap checks first: a bad path or number fails before any model is loaded.
        self.source = data_source(train_file, val_file, dataset, subset, train_split, val_split, columns)
        self.train_path, self.val_path = self.source.train_file, self.source.val_file
        # The ranges are the annotations (the CLI checks them while parsing); the same rule here.
        numbers = {"max_length": max_length, "batch_size": batch_size, "max_tokens_per_batch": max_tokens_per_batch, "num_proc": num_proc}
        check_arguments(SFTDataModule.__init__, numbers)
        if max_tokens_per_batch is not None:
            if max_tokens_per_batch < max_length:
                raise SettingError(
                    "max_tokens_per_batch",
                    f" ({max_tokens_per_batch}) is below `max_length` ({max_length}): the longest sample would not fit a batch",
                    siblings=("max_length",),
                )
            batch_size = None
        elif batch_size is None:
            raise SettingError("batch_size", "set `batch_size` (> 0) or `max_tokens_per_batch`", siblings=("max_tokens_per_batch",))
        if packing and max_tokens_per_batch is None:  # a packed row is the token budget
            raise SettingError("packing", ": true needs `max_tokens_per_batch` (the tokens of a packed row)",
                               siblings=("max_tokens_per_batch",))
        self.packing = packing
        if tokenizer is None:
            raise SettingError("tokenizer", " is not set: name the model folder or hub id to load it from")
        self.tokenizer_name = tokenizer
        self.max_length = max_length
        self.batch_size = batch_size
        self.max_tokens_per_batch = max_tokens_per_batch
        self.num_workers = num_workers
        self.seed = seed
        self.num_proc = num_proc
        self.cache_root = Path(cache_dir).expanduser() if cache_dir else default_cache_root(self.source)
        self.tokenizer: Any = None
        self.train_set: TokenizedDataset | None = None
        self.val_set: TokenizedDataset | None = None
        self.stats: dict[str, TokenizeStats] = {}

    def prepare_data(self) -> None:
        # Lightning calls this on each node's local rank 0 before any rank's setup: the cache is
        # built once per node (once in all, on a shared file system) while the other ranks wait.
        with settings_at(self.config_key):
            self._load_tokenizer()
            for name in ("train", "val") if self.source.has_val else ("train",):
                self._cached(name)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        with settings_at(self.config_key):
            self._load_tokenizer()
            self.train_set = self._load("train")
            if self.source.has_val:
                self.val_set = self._load("val")

    def _load_tokenizer(self) -> None:
        from lightning_mem.models import load_tokenizer

        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(self.tokenizer_name, key="tokenizer")

    def cache_folder(self, name: str) -> Path:
        """The cache folder of the ``"train"`` or ``"val"`` set under these settings."""
        parts = ["sft", source_identity(self.source, name), tokenizer_identity(self.tokenizer), self.max_length,
                 code_version(tokenize_batch, encode_rendered)]
        return self.cache_root / f"sft-{name}-{cache_key(parts)}"

    def _cached(self, name: str) -> tuple[Path, dict[str, Any]]:
        folder = self.cache_folder(name)
        return folder, build_once(folder, lambda tmp: self._build(name, tmp, folder.name))

    def _build(self, name: str, folder: Path, key: str) -> dict[str, Any]:
        where = self.source.describe(name)
        log.info(f"tokenizing {name} ({where}) into {folder.parent} with {self.num_proc} process(es)")
        raw, jsonl = raw_rows(self.source, name, folder)
        meta: dict[str, Any] = {"files": [], "stats": TokenizeStats().__dict__}
        if len(raw):
            function = partial(tokenize_batch, tokenizer=self.tokenizer, max_length=self.max_length, jsonl=jsonl, columns=self.source.columns)
            mapped = map_rows(raw, function, folder, num_proc=self.num_proc, features=_features(), key=key, desc=f"tokenizing {name}")
            status = column(mapped, "status")
            rows = status != BLANK
            dropped = np.flatnonzero(status == DROPPED)
            stats = TokenizeStats(
                rows=int(rows.sum()), truncated=int(column(mapped, "truncated")[rows].sum()), dropped=len(dropped),
                dropped_where=take_strings(mapped, dropped, "where"),
            )
            meta = {"files": arrow_files(mapped), "stats": stats.__dict__}
        del raw
        for f in folder.glob("raw-*.arrow"):
            f.unlink()
        return meta

    def _load(self, name: str) -> TokenizedDataset:
        where = self.source.describe(name)
        folder, meta = self._cached(name)
        stats = TokenizeStats(**meta["stats"])
        self.stats[name] = stats
        summary = stats.summary(f"{name} ({where})", self.max_length)
        if stats.truncated or stats.dropped:
            warn_once(summary + f"; raise `{join_key(self.config_key, 'max_length')}` to keep whole rows")
        else:
            log.info(summary)
        if stats.rows - stats.dropped <= 0:
            raise DataFormatError(f"{where}: no usable rows after tokenization")
        return TokenizedDataset(open_arrow(folder, meta["files"]))

    def _sampler(self, dataset: TokenizedDataset, shuffle: bool, *, train: bool = False) -> TokenBudgetSampler:
        trainer = self.trainer
        replicas, replica = data_parallel(trainer)
        rows = {"row_length": self.max_length} if self.packing else {}  # rows no longer than a padded one's
        return (packed.PackedBatchSampler if self.packing else TokenBudgetSampler)(
            dataset.lengths,
            **rows,
            # A rank of a context-parallel group holds 1/cp of each sequence: the budget is per rank.
            max_tokens=per_rank_budget(self.max_tokens_per_batch, trainer),
            batch_size=self.batch_size,
            # The replicas read different batches; a tensor- or context-parallel group shares one.
            num_replicas=replicas,
            rank=replica,
            shuffle=shuffle,
            seed=self.seed,
            # Training batches carry their optimizer step's label tokens (all micro-batches, all
            # ranks): the SFT loss is a token mean over the step, whatever the split.
            weights=dataset.label_tokens if train else None,
            accumulate_grad_batches=trainer.accumulate_grad_batches if train and trainer else 1,
        )

    def _loader(self, dataset: TokenizedDataset, sampler: TokenBudgetSampler) -> DataLoader:
        return DataLoader(
            dataset,
            sampler=sampler,
            batch_size=None,  # the sampler yields whole batches
            collate_fn=_Collator(self.tokenizer.pad_token_id, packing=self.packing, row_length=self.max_length),
            num_workers=self.num_workers,
        )

    def largest_batch(self, fill_token: int, context_parallel_size: int = 1) -> dict[str, torch.Tensor]:
        """The largest training micro-batch these settings allow, made of ``fill_token``: as many
        rows as the token budget (or ``batch_size``) takes, each ``max_length`` tokens, every token a
        label; with ``context_parallel_size`` ranks sharing each row, the budget is per rank
        (:func:`lightning_mem.ranks.per_rank_budget`). The memory estimate
        (:mod:`lightning_mem.estimate`) runs the recipe on it; no data are read."""
        if self.packing:
            return packed.largest_packed_batch(fill_token, self.max_tokens_per_batch, self.max_length)
        budget = self.max_tokens_per_batch and self.max_tokens_per_batch * context_parallel_size
        rows = budget // self.max_length if budget else self.batch_size
        ids = torch.full((max(rows, 1), self.max_length), fill_token, dtype=torch.long)
        return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids),
                "step_label_tokens": torch.tensor(ids.numel(), dtype=torch.long)}

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None, "call setup() first"
        sampler = self._sampler(self.train_set, shuffle=True, train=True)
        resume_where_stopped(sampler, self.trainer)
        return self._loader(self.train_set, sampler)

    def val_dataloader(self) -> DataLoader | list:
        if self.val_set is None:
            return []
        return self._loader(self.val_set, self._sampler(self.val_set, shuffle=False))
