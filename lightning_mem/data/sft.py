"""SFT data: conversations tokenized with the loss masked to the assistant's tokens, truncated,
and batched by token budget; the :class:`SFTDataModule` the SFT and QLoRA recipes train on."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from jsonargparse.typing import PositiveInt
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset

from lightning_mem.batching import MicroBatch, TokenBudgetSampler, resume_where_stopped
from lightning_mem.data.chat import encode_rendered, render_with_spans, row_to_conversation
from lightning_mem.data.rows import DataFormatError, data_source, warn_once
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


class TokenizedDataset(Dataset):
    """A list of tokenized examples; indexing with a list returns a list (for batch samplers)."""

    def __init__(self, examples: list[dict[str, list[int]]]) -> None:
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, idx: int | list[int]) -> Any:
        if isinstance(idx, MicroBatch):  # keeps its step's label-token total for the collator
            batch = MicroBatch(self.examples[i] for i in idx)
            batch.step_weight = idx.step_weight
            return batch
        if isinstance(idx, list):
            return [self.examples[i] for i in idx]
        return self.examples[idx]

    @property
    def lengths(self) -> list[int]:
        return [len(e["input_ids"]) for e in self.examples]

    @property
    def label_tokens(self) -> list[int]:
        """Tokens each example is scored on: labels that a previous position predicts (the first
        token is never a target)."""
        return [sum(label != IGNORE_INDEX for label in e["labels"][1:]) for e in self.examples]


def collate_right_padded(examples: list[dict[str, list[int]]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Pad on the right: ``input_ids`` with pad, ``labels`` with -100, and an attention mask."""
    input_ids, attention_mask = pad_sequences([e["input_ids"] for e in examples], pad_token_id)
    labels, _ = pad_sequences([e["labels"] for e in examples], IGNORE_INDEX)
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


class _Collator:
    # A class, not a lambda, so that DataLoader workers can pickle it.
    def __init__(self, pad_token_id: int) -> None:
        self.pad_token_id = pad_token_id

    def __call__(self, examples: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        batch = collate_right_padded(examples, self.pad_token_id)
        if isinstance(examples, MicroBatch) and examples.step_weight is not None:
            # The label tokens of this micro-batch's whole optimizer step, on all ranks.
            batch["step_label_tokens"] = torch.tensor(int(examples.step_weight), dtype=torch.long)  # an int: precision plugins cast floats
        return batch


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
    ) -> None:
        super().__init__()
        # Cheap checks first: a bad path or number fails before any model is loaded.
        self.source = data_source(train_file, val_file, dataset, subset, train_split, val_split, columns)
        self.train_path, self.val_path = self.source.train_file, self.source.val_file
        # The ranges are the annotations (the CLI checks them while parsing); the same rule here.
        numbers = {"max_length": max_length, "batch_size": batch_size, "max_tokens_per_batch": max_tokens_per_batch}
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
        if tokenizer is None:
            raise SettingError("tokenizer", " is not set: name the model folder or hub id to load it from")
        self.tokenizer_name = tokenizer
        self.max_length = max_length
        self.batch_size = batch_size
        self.max_tokens_per_batch = max_tokens_per_batch
        self.num_workers = num_workers
        self.seed = seed
        self.tokenizer: Any = None
        self.train_set: TokenizedDataset | None = None
        self.val_set: TokenizedDataset | None = None
        self.stats: dict[str, TokenizeStats] = {}

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        from lightning_mem.models import load_tokenizer

        with settings_at(self.config_key):
            self.tokenizer = load_tokenizer(self.tokenizer_name, key="tokenizer")
            self.train_set = self._load("train")
            if self.source.has_val:
                self.val_set = self._load("val")

    def _load(self, name: str) -> TokenizedDataset:
        where = self.source.describe(name)
        examples, stats = tokenize_rows(self.source.rows(name), self.tokenizer, self.max_length)
        self.stats[name] = stats
        summary = stats.summary(f"{name} ({where})", self.max_length)
        if stats.truncated or stats.dropped:
            warn_once(summary + f"; raise `{join_key(self.config_key, 'max_length')}` to keep whole rows")
        else:
            log.info(summary)
        if not examples:
            raise DataFormatError(f"{where}: no usable rows after tokenization")
        return TokenizedDataset(examples)

    def _sampler(self, dataset: TokenizedDataset, shuffle: bool, *, train: bool = False) -> TokenBudgetSampler:
        trainer = self.trainer
        replicas, replica = data_parallel(trainer)
        return TokenBudgetSampler(
            dataset.lengths,
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
            collate_fn=_Collator(self.tokenizer.pad_token_id),
            num_workers=self.num_workers,
        )

    def largest_batch(self, fill_token: int) -> dict[str, torch.Tensor]:
        """The largest training micro-batch these settings allow, made of ``fill_token``: as many
        rows as the token budget (or ``batch_size``) takes, each ``max_length`` tokens, every token a
        label. The memory estimate (:mod:`lightning_mem.estimate`) runs the recipe on it; no data
        are read."""
        rows = self.max_tokens_per_batch // self.max_length if self.max_tokens_per_batch else self.batch_size
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
