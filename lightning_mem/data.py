"""Instruction data: read chat or prompt/completion rows, format them with the tokenizer's chat
template, mask the loss to the assistant's tokens, truncate, and batch by token budget.

Row shapes accepted (JSONL, JSON or Parquet):

- ``{"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}, ...]}``:
  the loss covers every assistant turn.
- ``{"prompt": ..., "completion": ...}`` (optionally ``"system"``): the loss covers the completion.

Other keys (e.g. ``answer`` for a reward rule) are carried along untouched.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset

from lightning_mem.batching import MicroBatch, TokenBudgetSampler

log = logging.getLogger(__name__)

IGNORE_INDEX = -100
_FORMATS = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet"}


class DataFormatError(ValueError):
    """A data file or row that cannot be used; the message names the file and line."""


# ---------------------------------------------------------------------------------------------
# Reading rows
# ---------------------------------------------------------------------------------------------


def check_data_file(path: str | Path, *, key: str) -> Path:
    """Fail early, naming the config key, when a data file is missing or of an unknown format."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"`{key}`: data file {str(path)!r} does not exist")
    if p.suffix not in _FORMATS:
        raise DataFormatError(f"`{key}`: {str(path)!r} has an unknown format; use one of {sorted(_FORMATS)}")
    return p


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Read a JSONL file ourselves (so a bad line is reported by number), other formats via `datasets`."""
    p = Path(path)
    if p.suffix == ".jsonl":
        rows = []
        with p.open() as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise DataFormatError(f"{p}:{lineno}: not valid JSON ({err.msg})") from None
                if not isinstance(row, dict):
                    raise DataFormatError(f"{p}:{lineno}: expected a JSON object, got {type(row).__name__}")
                row["_where"] = f"{p}:{lineno}"
                rows.append(row)
        return rows
    import datasets

    table = datasets.load_dataset(_FORMATS[p.suffix], data_files=str(p), split="train")
    return [dict(row, _where=f"{p}:row {i}") for i, row in enumerate(table)]


def check_messages(messages: Any, where: str) -> None:
    """A non-empty list of ``{"role": str, "content": str}``, or an error naming the row."""
    if not isinstance(messages, list) or not messages:
        raise DataFormatError(f"{where}: `messages` must be a non-empty list")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataFormatError(f"{where}: each message needs string `role` and `content`, got {m!r}")


def row_to_messages(row: dict[str, Any]) -> list[dict[str, str]]:
    """Normalise a row to chat messages, or raise naming the row's file and line."""
    where = row.get("_where", "row")
    if "messages" in row:
        messages = row["messages"]
        check_messages(messages, where)
        if not any(m["role"] == "assistant" for m in messages):
            raise DataFormatError(f"{where}: `messages` has no assistant turn to learn from")
        return messages
    if isinstance(row.get("prompt"), str) and isinstance(row.get("completion"), str):
        messages = [{"role": "system", "content": row["system"]}] if row.get("system") else []
        return messages + [
            {"role": "user", "content": row["prompt"]},
            {"role": "assistant", "content": row["completion"]},
        ]
    keys = sorted(k for k in row if k != "_where")
    raise DataFormatError(f"{where}: row needs `messages` or string `prompt` and `completion`; it has keys {keys}")


# ---------------------------------------------------------------------------------------------
# Formatting and tokenizing
# ---------------------------------------------------------------------------------------------


def render_with_spans(messages: list[dict[str, str]], tokenizer: Any) -> tuple[str, list[tuple[int, int]]]:
    """Render a conversation to text and return the character spans of the assistant turns.

    With a chat template, the span of assistant turn i runs from the end of the rendering of
    ``messages[:i]`` with a generation prompt to the end of the rendering of ``messages[:i+1]``,
    which includes the template's end-of-turn token (so the model learns to stop).
    Without a template: ``role: content`` lines, and the eos token after each assistant turn.
    """
    if getattr(tokenizer, "chat_template", None):

        def render(msgs: list[dict[str, str]], gen: bool) -> str:
            return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

        text = render(messages, False)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            start, end = len(render(messages[:i], True)), len(render(messages[: i + 1], False))
            if not text.startswith(render(messages[: i + 1], False)):
                raise DataFormatError("the tokenizer's chat template does not render conversations prefix by prefix")
            spans.append((start, end))
        return text, spans
    text, spans = "", []
    eos = tokenizer.eos_token or ""
    for m in messages:
        if m["role"] == "assistant":
            text += "assistant: "
            start = len(text)
            text += m["content"] + eos
            spans.append((start, len(text)))
            text += "\n"
        else:
            text += f"{m['role']}: {m['content']}\n"
    return text, spans


def render_prompt(messages: list[dict[str, str]], tokenizer: Any) -> str:
    """The text a model continues to answer ``messages`` (the generation prompt, for rollouts and eval)."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


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
    messages: list[dict[str, str]], tokenizer: Any, max_length: int
) -> tuple[dict[str, list[int]] | None, bool]:
    """Token ids and labels (-100 outside assistant spans), truncated to ``max_length``.

    Returns ``(example or None if nothing is left to learn, was_truncated)``.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError("a fast (Rust) tokenizer is required: loss masking uses its offset mapping")
    text, spans = render_with_spans(messages, tokenizer)
    has_template = bool(getattr(tokenizer, "chat_template", None))
    # A chat template writes its own special tokens (bos included); plain text gets the tokenizer's.
    enc = tokenizer(text, add_special_tokens=not has_template, return_offsets_mapping=True)
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
        example, truncated = tokenize_example(row_to_messages(row), tokenizer, max_length)
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
    longest = max(len(e["input_ids"]) for e in examples)
    input_ids = torch.full((len(examples), longest), pad_token_id, dtype=torch.long)
    labels = torch.full((len(examples), longest), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), longest), dtype=torch.long)
    for row, e in enumerate(examples):
        n = len(e["input_ids"])
        input_ids[row, :n] = torch.tensor(e["input_ids"])
        labels[row, :n] = torch.tensor(e["labels"])
        attention_mask[row, :n] = 1
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


def resume_where_stopped(sampler: TokenBudgetSampler, trainer: Any) -> None:
    """Position a training sampler by the batches the trainer has already run.

    Lightning restores its batch counters from a checkpoint but replays a plain DataLoader from
    the start (and, from a checkpoint taken on an epoch's last batch, resumes with the next epoch
    number); positioning by batches run makes a resumed run see exactly the uninterrupted batches.
    """
    if trainer is None:
        return
    progress = trainer.fit_loop.epoch_loop.batch_progress
    sampler.position_fn = lambda: progress.total.processed


# ---------------------------------------------------------------------------------------------
# The datamodule
# ---------------------------------------------------------------------------------------------


class SFTDataModule(LightningDataModule):
    """Instruction-tuning data for a causal LM.

    Args:
        train_file: JSONL, JSON or Parquet with ``messages`` or ``prompt``/``completion`` rows.
        val_file: optional, same format.
        tokenizer: model folder or hub id to load the tokenizer from (the CLI links it to
            ``model.name_or_path``).
        max_length: tokens per sample; longer rows are truncated, and rows with no completion token
            left are dropped (both counted and logged).
        batch_size: samples per micro-batch, when ``max_tokens_per_batch`` is not set.
        max_tokens_per_batch: pack micro-batches up to this many padded tokens instead.
        seed: shuffling seed; each epoch reshuffles deterministically from it.
    """

    def __init__(
        self,
        train_file: str,
        val_file: str | None = None,
        tokenizer: str | None = None,
        max_length: int = 1024,
        batch_size: int | None = 8,
        max_tokens_per_batch: int | None = None,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        # Cheap checks first: a bad path or number fails before any model is loaded.
        self.train_path = check_data_file(train_file, key="data.train_file")
        self.val_path = check_data_file(val_file, key="data.val_file") if val_file else None
        if max_length <= 0:
            raise ValueError(f"`data.max_length` must be positive, got {max_length}")
        if max_tokens_per_batch is not None:
            if max_tokens_per_batch < max_length:
                raise ValueError(
                    f"`data.max_tokens_per_batch` ({max_tokens_per_batch}) is below `data.max_length` ({max_length}):"
                    " the longest sample would not fit a batch"
                )
            batch_size = None
        elif batch_size is None or batch_size <= 0:
            raise ValueError("set `data.batch_size` (> 0) or `data.max_tokens_per_batch`")
        if tokenizer is None:
            raise ValueError("`data.tokenizer` is not set (the recipes link it to `model.name_or_path`)")
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

        self.tokenizer = load_tokenizer(self.tokenizer_name, key="data.tokenizer")
        self.train_set = self._load("train", self.train_path)
        if self.val_path is not None:
            self.val_set = self._load("val", self.val_path)

    def _load(self, name: str, path: Path) -> TokenizedDataset:
        examples, stats = tokenize_rows(read_rows(path), self.tokenizer, self.max_length)
        self.stats[name] = stats
        log.warning(stats.summary(f"{name} ({path})", self.max_length)) if stats.dropped else log.info(
            stats.summary(f"{name} ({path})", self.max_length)
        )
        if not examples:
            raise DataFormatError(f"{path}: no usable rows after tokenization")
        return TokenizedDataset(examples)

    def _sampler(self, dataset: TokenizedDataset, shuffle: bool, *, train: bool = False) -> TokenBudgetSampler:
        trainer = self.trainer
        return TokenBudgetSampler(
            dataset.lengths,
            max_tokens=self.max_tokens_per_batch,
            batch_size=self.batch_size,
            num_replicas=trainer.world_size if trainer else 1,
            rank=trainer.global_rank if trainer else 0,
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

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None, "call setup() first"
        sampler = self._sampler(self.train_set, shuffle=True, train=True)
        resume_where_stopped(sampler, self.trainer)
        return self._loader(self.train_set, sampler)

    def val_dataloader(self) -> DataLoader | list:
        if self.val_set is None:
            return []
        return self._loader(self.val_set, self._sampler(self.val_set, shuffle=False))


# ---------------------------------------------------------------------------------------------
# Prompt sets for RL: prompts only, kept with their rows (a reward rule reads e.g. `answer`)
# ---------------------------------------------------------------------------------------------


def row_to_prompt_messages(row: dict[str, Any]) -> list[dict[str, str]]:
    """The conversation a policy continues: ``{"prompt": str}`` (optionally ``"system"``), or
    ``{"messages": [...]}`` ending in a turn that is not the assistant's."""
    where = row.get("_where", "row")
    if isinstance(row.get("prompt"), str):
        messages = [{"role": "system", "content": row["system"]}] if row.get("system") else []
        return messages + [{"role": "user", "content": row["prompt"]}]
    if "messages" in row:
        messages = row["messages"]
        check_messages(messages, where)
        if messages[-1]["role"] == "assistant":
            raise DataFormatError(f"{where}: a prompt's `messages` must end before the assistant's answer")
        return messages
    keys = sorted(k for k in row if k != "_where")
    raise DataFormatError(f"{where}: a prompt row needs a string `prompt` or `messages`; it has keys {keys}")


class PromptDataset(Dataset):
    """Tokenized prompts and their rows; indexing with a list returns a list (for batch samplers)."""

    def __init__(self, prompt_ids: list[list[int]], rows: list[dict[str, Any]]) -> None:
        self.prompt_ids, self.rows = prompt_ids, rows

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def __getitem__(self, idx: int | list[int]) -> Any:
        if isinstance(idx, list):
            return [self[i] for i in idx]
        return {"prompt_ids": self.prompt_ids[idx], "row": self.rows[idx]}


def collate_left_padded(items: list[dict[str, Any]], pad_token_id: int) -> dict[str, Any]:
    """Prompts padded on the left, so that generation continues every row from the same column."""
    longest = max(len(item["prompt_ids"]) for item in items)
    input_ids = torch.full((len(items), longest), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(items), longest), dtype=torch.long)
    for i, item in enumerate(items):
        n = len(item["prompt_ids"])
        input_ids[i, longest - n :] = torch.tensor(item["prompt_ids"])
        attention_mask[i, longest - n :] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "rows": [item["row"] for item in items]}


class _PromptCollator:
    def __init__(self, pad_token_id: int) -> None:
        self.pad_token_id = pad_token_id

    def __call__(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        return collate_left_padded(items, self.pad_token_id)


class FullBatchSampler(TokenBudgetSampler):
    """Batches of exactly ``batch_size`` prompts on every rank; an incomplete remainder is dropped.

    An RL step must see the same number of samples on every rank: the number of mini- and
    micro-batches, and so the number of collective calls, follows from it.
    """

    def _plan(self) -> list[list[int]]:
        order = list(range(len(self.lengths)))
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed)
            order = torch.randperm(len(order), generator=g).tolist()
        full = len(order) // self.batch_size * self.batch_size
        batches = [order[i : i + self.batch_size] for i in range(0, full, self.batch_size)]
        return batches[: len(batches) - len(batches) % self.num_replicas]


class PromptDataModule(LightningDataModule):
    """Prompts for PPO/GRPO rollouts.

    Args:
        train_file: JSONL, JSON or Parquet; rows with a string ``prompt`` (optionally ``system``)
            or ``messages`` ending before the assistant's turn. Other keys (``answer``...) ride
            along to the reward function.
        tokenizer: model folder or hub id (the PPO recipe links it to ``model.name_or_path``).
        max_prompt_length: prompts with more tokens are dropped (counted and logged): cutting a
            prompt would change the question the reward judges.
        system_prompt: a system message for rows that bring none (e.g. "Answer with the number
            only."); None adds nothing.
        batch_size: prompts per rank per PPO step (GRPO samples ``group_size`` responses each).
        seed: shuffling seed; each epoch reshuffles deterministically from it.
    """

    def __init__(
        self,
        train_file: str,
        tokenizer: str | None = None,
        max_prompt_length: int = 512,
        batch_size: int = 8,
        system_prompt: str | None = None,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.train_path = check_data_file(train_file, key="data.train_file")
        self.system_prompt = system_prompt
        if max_prompt_length <= 0:
            raise ValueError(f"`data.max_prompt_length` must be positive, got {max_prompt_length}")
        if batch_size <= 0:
            raise ValueError(f"`data.batch_size` must be positive, got {batch_size}")
        if tokenizer is None:
            raise ValueError("`data.tokenizer` is not set (the recipes link it to `model.name_or_path`)")
        self.tokenizer_name = tokenizer
        self.max_prompt_length = max_prompt_length
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.seed = seed
        self.tokenizer: Any = None
        self.train_set: PromptDataset | None = None
        self.dropped: list[str] = []

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        from lightning_mem.models import load_tokenizer

        self.tokenizer = load_tokenizer(self.tokenizer_name, key="data.tokenizer")
        rows = read_rows(self.train_path)
        has_template = bool(getattr(self.tokenizer, "chat_template", None))
        prompt_ids, kept = [], []
        for row in rows:
            row = self._with_system_prompt(row)
            text = render_prompt(row_to_prompt_messages(row), self.tokenizer)
            ids = self.tokenizer(text, add_special_tokens=not has_template)["input_ids"]
            if len(ids) > self.max_prompt_length:
                self.dropped.append(row.get("_where", "?"))
                continue
            prompt_ids.append(ids)
            kept.append(row)
        summary = f"prompts ({self.train_path}): {len(rows)} rows, {len(self.dropped)} dropped as longer than max_prompt_length={self.max_prompt_length}"
        log.warning(summary) if self.dropped else log.info(summary)
        world = self.trainer.world_size if self.trainer else 1
        if len(kept) < self.batch_size * world:
            raise DataFormatError(
                f"{self.train_path}: {len(kept)} usable prompts, fewer than one step needs"
                f" (`data.batch_size`={self.batch_size} x {world} ranks)"
            )
        self.train_set = PromptDataset(prompt_ids, kept)

    def _with_system_prompt(self, row: dict[str, Any]) -> dict[str, Any]:
        # Written into the row, so that whatever rebuilds the conversation from it later (a reward
        # model) sees the same system message as the policy.
        if not self.system_prompt:
            return row
        if isinstance(row.get("prompt"), str):
            return row if row.get("system") else {**row, "system": self.system_prompt}
        messages = row.get("messages")
        if isinstance(messages, list) and messages and isinstance(messages[0], dict) and messages[0].get("role") != "system":
            return {**row, "messages": [{"role": "system", "content": self.system_prompt}, *messages]}
        return row

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None, "call setup() first"
        trainer = self.trainer
        sampler = FullBatchSampler(
            [len(p) for p in self.train_set.prompt_ids],
            batch_size=self.batch_size,
            num_replicas=trainer.world_size if trainer else 1,
            rank=trainer.global_rank if trainer else 0,
            shuffle=True,
            seed=self.seed,
        )
        resume_where_stopped(sampler, trainer)
        return DataLoader(
            self.train_set,
            sampler=sampler,
            batch_size=None,
            collate_fn=_PromptCollator(self.tokenizer.pad_token_id),
            num_workers=self.num_workers,
        )
