"""Instruction data: read chat or prompt/completion rows, format them with the tokenizer's chat
template, mask the loss to the assistant's tokens, truncate, and batch by token budget.

Sources: JSONL, JSON or Parquet files, folders written by ``datasets``' ``save_to_disk``, and
Hugging Face hub datasets (``datasets.load_dataset``). Row shapes accepted (mixed freely):

- ``{"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}, ...]}``:
  the loss covers every assistant turn.
- ``{"prompt": ..., "completion": ...}`` (optionally ``"system"``), each a string or, as in TRL's
  conversational format, a list of messages: the loss covers the completion's assistant turns.

A column mapping (``columns: {prompt: question}``) renames other datasets' fields. Other keys
(e.g. ``answer`` for a reward rule) are carried along untouched.
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


def is_saved_dataset(path: Path) -> bool:
    """A folder written by ``datasets``' ``save_to_disk`` (a Dataset or a DatasetDict)."""
    return (path / "dataset_dict.json").is_file() or ((path / "state.json").is_file() and (path / "dataset_info.json").is_file())


def check_data_file(path: str | Path, *, key: str) -> Path:
    """Fail early, naming the config key, when a data file is missing or of an unknown format.

    A folder is accepted when ``datasets`` wrote it with ``save_to_disk``.
    """
    p = Path(path).expanduser()
    if p.is_dir():
        if is_saved_dataset(p):
            return p
        raise DataFormatError(
            f"`{key}`: {str(path)!r} is a directory, not a data file; a folder must be a `datasets` save_to_disk"
            " folder (with dataset_info.json and state.json, or dataset_dict.json)"
        )
    if not p.is_file():
        raise FileNotFoundError(f"`{key}`: data file {str(path)!r} does not exist")
    if p.suffix not in _FORMATS:
        raise DataFormatError(f"`{key}`: {str(path)!r} has an unknown format; use one of {sorted(_FORMATS)}")
    return p


def _clean(value: Any) -> Any:
    # Arrow gives every row every column of the file (None where a row had none) and every message
    # every key any message had: drop the Nones so that a `messages` row mixed with
    # prompt/completion rows reads as the row that was written.
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def _record(row: Any, where: str) -> dict[str, Any]:
    if not isinstance(row, dict):
        raise DataFormatError(f"{where}: expected a JSON object, got {type(row).__name__}")
    return {**_clean(row), "_where": where}


def _decode(data: bytes, p: Path, line_offset: int = 0) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = line_offset + data[: err.start].count(b"\n") + 1
        raise DataFormatError(f"{p}:{line}: not valid UTF-8 (byte {data[err.start]:#04x}); save the file as UTF-8") from None


def _read_jsonl(p: Path) -> list[dict[str, Any]]:
    rows = []
    with p.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            line = _decode(raw, p, lineno - 1)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataFormatError(f"{p}:{lineno}: not valid JSON ({err.msg})") from None
            rows.append(_record(row, f"{p}:{lineno}"))
    return rows


def _read_json(p: Path) -> list[dict[str, Any]]:
    # Read here rather than through Arrow: rows of different shapes (messages and prompt/completion,
    # string and conversational prompts) would otherwise be forced into one schema.
    text = _decode(p.read_bytes(), p)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        if err.msg == "Extra data" and text.lstrip().startswith("{"):
            return _read_jsonl(p)  # JSON Lines under a .json name, as `datasets` accepts
        raise DataFormatError(f"{p}:{err.lineno}:{err.colno}: not valid JSON ({err.msg})") from None
    if isinstance(data, dict) and len(data) == 1 and isinstance(next(iter(data.values())), list):
        data = next(iter(data.values()))  # {"data": [...]}: one top-level list of rows
    if not isinstance(data, list):
        raise DataFormatError(f"{p}: expected a JSON array of row objects, got {type(data).__name__}")
    return [_record(row, f"{p}:row {i}") for i, row in enumerate(data)]


def _read_parquet(p: Path) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(p)
    except Exception as err:  # pyarrow's messages do not name the file
        raise DataFormatError(f"{p}: not a readable Parquet file ({err})") from None
    return [_record(row, f"{p}:row {i}") for i, row in enumerate(table.to_pylist())]


def _read_saved(p: Path, split: str | None, split_key: str) -> list[dict[str, Any]]:
    import datasets

    try:
        data = datasets.load_from_disk(str(p))
    except Exception as err:
        raise DataFormatError(f"{p}: not a readable `datasets` save_to_disk folder ({err})") from None
    if isinstance(data, datasets.DatasetDict):
        if split not in data:
            raise DataFormatError(f"`{split_key}`: {p} holds the splits {sorted(data)}, not {split!r}")
        data, where = data[split], f"{p}[{split}]"
    else:
        where = str(p)
    return [_record(row, f"{where}:row {i}") for i, row in enumerate(data)]


def read_rows(path: str | Path, *, split: str | None = "train", split_key: str = "data.train_split") -> list[dict[str, Any]]:
    """Rows of a JSONL, JSON or Parquet file, or of a ``save_to_disk`` folder (``split`` of a
    DatasetDict). Each row gets ``_where`` (file and line or row number) for error messages."""
    p = Path(path)
    if p.is_dir():
        return _read_saved(p, split, split_key)
    if p.suffix == ".jsonl":
        return _read_jsonl(p)
    if p.suffix == ".json":
        return _read_json(p)
    return _read_parquet(p)


def read_hub_rows(dataset: str, *, subset: str | None, split: str, key: str = "data.dataset") -> list[dict[str, Any]]:
    """Rows of a Hugging Face hub dataset: ``datasets.load_dataset(dataset, name=subset, split=split)``.

    Downloads go to the ``datasets`` cache (``HF_DATASETS_CACHE``); offline, the cache is used.
    """
    import datasets

    try:
        data = datasets.load_dataset(dataset, name=subset, split=split)
    except Exception as err:
        raise DataFormatError(f"`{key}`: could not load {dataset!r} (subset={subset!r}, split={split!r}): {err}") from None
    where = f"{dataset}" + (f"/{subset}" if subset else "") + f"[{split}]"
    return [_record(row, f"{where}:row {i}") for i, row in enumerate(data)]


def rename_columns(rows: list[dict[str, Any]], columns: dict[str, str] | None, *, key: str = "data.columns") -> list[dict[str, Any]]:
    """Give the dataset's fields the names this module reads: ``{prompt: question}`` moves each
    row's ``question`` to ``prompt``. A row without a mapped field is an error naming it."""
    if not columns:
        return rows
    out = []
    for row in rows:
        row = dict(row)
        for ours, theirs in columns.items():
            if theirs not in row:
                keys = sorted(k for k in row if k != "_where")
                raise DataFormatError(
                    f"`{key}.{ours}`: {row.get('_where', 'row')} has no field {theirs!r}; it has {keys}"
                )
            row[ours] = row.pop(theirs)
        out.append(row)
    return out


def check_columns(columns: Any, *, key: str = "data.columns") -> dict[str, str] | None:
    if columns is None:
        return None
    if not isinstance(columns, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in columns.items()):
        raise ValueError(f"`{key}` must map field names this module reads to the dataset's names, e.g. {{prompt: question}}; got {columns!r}")
    return dict(columns)


def check_messages(messages: Any, where: str, field: str = "messages") -> None:
    """A non-empty list of ``{"role": str, "content": str}``, or an error naming the row."""
    if not isinstance(messages, list) or not messages:
        raise DataFormatError(f"{where}: `{field}` must be a non-empty list")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataFormatError(f"{where}: each message in `{field}` needs string `role` and `content`, got {m!r}")


def _as_messages(value: Any, role: str, where: str, field: str) -> list[dict[str, str]]:
    # A string prompt is one user turn, a string completion one assistant turn; a list is TRL's
    # conversational form.
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    check_messages(value, where, field)
    return value


def _system(row: dict[str, Any], messages: list[dict[str, str]]) -> list[dict[str, str]]:
    if row.get("system") and messages[0]["role"] != "system":
        return [{"role": "system", "content": row["system"]}]
    return []


def row_to_conversation(row: dict[str, Any]) -> tuple[list[dict[str, str]], int]:
    """``(messages, first)``: the conversation, and the index of its first message the loss may
    cover (assistant turns from there on are learned). Raises naming the row's file and line."""
    where = row.get("_where", "row")
    if "messages" in row:
        messages = row["messages"]
        check_messages(messages, where)
        if not any(m["role"] == "assistant" for m in messages):
            raise DataFormatError(f"{where}: `messages` has no assistant turn to learn from")
        return messages, 0
    if isinstance(row.get("prompt"), (str, list)) and isinstance(row.get("completion"), (str, list)):
        prompt = _as_messages(row["prompt"], "user", where, "prompt")
        completion = _as_messages(row["completion"], "assistant", where, "completion")
        if not any(m["role"] == "assistant" for m in completion):
            raise DataFormatError(f"{where}: `completion` has no assistant turn to learn from")
        prompt = _system(row, prompt) + prompt
        return prompt + completion, len(prompt)
    keys = sorted(k for k in row if k != "_where")
    raise DataFormatError(
        f"{where}: row needs `messages` or `prompt` and `completion` (strings or lists of messages); it has keys {keys}"
    )


def row_to_messages(row: dict[str, Any]) -> list[dict[str, str]]:
    """Normalise a row to chat messages, or raise naming the row's file and line."""
    return row_to_conversation(row)[0]


# ---------------------------------------------------------------------------------------------
# Formatting and tokenizing
# ---------------------------------------------------------------------------------------------


def render_with_spans(
    messages: list[dict[str, str]], tokenizer: Any, first: int = 0
) -> tuple[str, list[tuple[int, int]]]:
    """Render a conversation to text and return the character spans of the assistant turns
    from ``messages[first]`` on (earlier turns, e.g. a conversational prompt's history, are context).

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
            if m["role"] != "assistant" or i < first:
                continue
            start, end = len(render(messages[:i], True)), len(render(messages[: i + 1], False))
            if not text.startswith(render(messages[: i + 1], False)):
                raise DataFormatError("the tokenizer's chat template does not render conversations prefix by prefix")
            spans.append((start, end))
        return text, spans
    text, spans = "", []
    eos = tokenizer.eos_token or ""
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            text += "assistant: "
            start = len(text)
            text += m["content"] + eos
            if i >= first:
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
    messages: list[dict[str, str]], tokenizer: Any, max_length: int, first: int = 0
) -> tuple[dict[str, list[int]] | None, bool]:
    """Token ids and labels (-100 outside the assistant spans from ``messages[first]`` on),
    truncated to ``max_length``.

    Returns ``(example or None if nothing is left to learn, was_truncated)``.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError("a fast (Rust) tokenizer is required: loss masking uses its offset mapping")
    text, spans = render_with_spans(messages, tokenizer, first)
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
# Where the rows come from
# ---------------------------------------------------------------------------------------------


@dataclass
class DataSource:
    """A datamodule's rows: local files or ``save_to_disk`` folders, or a Hugging Face hub dataset.

    Built by :func:`data_source`, which checks the settings (naming their keys) without reading data.
    """

    train_file: Path | None = None
    val_file: Path | None = None
    dataset: str | None = None
    subset: str | None = None
    train_split: str = "train"
    val_split: str | None = None
    columns: dict[str, str] | None = None

    @property
    def has_val(self) -> bool:
        return self.val_file is not None or self.val_split is not None

    def describe(self, which: str) -> str:
        path = self.train_file if which == "train" else self.val_file
        if path is not None:
            return str(path)
        split = self.train_split if which == "train" else self.val_split
        return f"{self.dataset}" + (f"/{self.subset}" if self.subset else "") + f"[{split}]"

    def rows(self, which: str = "train") -> list[dict[str, Any]]:
        """Read the ``"train"`` or ``"val"`` rows, with ``columns`` applied."""
        if which == "train":
            if self.train_file is not None:
                rows = read_rows(self.train_file, split=self.train_split, split_key="data.train_split")
            else:
                rows = read_hub_rows(self.dataset, subset=self.subset, split=self.train_split)
        elif self.val_file is not None:
            rows = read_rows(self.val_file, split=self.val_split, split_key="data.val_split")
        elif self.train_file is not None:
            rows = read_rows(self.train_file, split=self.val_split, split_key="data.val_split")
        else:
            rows = read_hub_rows(self.dataset, subset=self.subset, split=self.val_split)
        return rename_columns(rows, self.columns)


def _has_splits(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file()


def data_source(
    train_file: str | None,
    val_file: str | None = None,
    dataset: str | None = None,
    subset: str | None = None,
    train_split: str = "train",
    val_split: str | None = None,
    columns: dict[str, str] | None = None,
) -> DataSource:
    """Check a datamodule's data settings, naming the key at fault; reads nothing."""
    if (train_file is None) == (dataset is None):
        raise ValueError(
            "set exactly one of `data.train_file` (a JSONL/JSON/Parquet file or a save_to_disk folder) and"
            f" `data.dataset` (a Hugging Face hub id); got train_file={train_file!r}, dataset={dataset!r}"
        )
    if subset is not None and dataset is None:
        raise ValueError("`data.subset` names a configuration of a hub dataset: set `data.dataset` too")
    if dataset is not None and not (isinstance(dataset, str) and dataset.strip()):
        raise ValueError(f"`data.dataset` must be a hub id such as 'trl-lib/Capybara', got {dataset!r}")
    train_path = check_data_file(train_file, key="data.train_file") if train_file is not None else None
    val_path = check_data_file(val_file, key="data.val_file") if val_file else None
    if val_split is not None and val_path is None and train_path is not None and not _has_splits(train_path):
        raise ValueError(
            "`data.val_split` picks a split of `data.dataset` or of a save_to_disk DatasetDict folder;"
            f" `data.train_file` {str(train_path)!r} has no splits: set `data.val_file` instead"
        )
    if val_path is not None and _has_splits(val_path) and val_split is None:
        raise ValueError(f"`data.val_split`: `data.val_file` {str(val_path)!r} is a DatasetDict folder; name its split")
    return DataSource(train_path, val_path, dataset, subset, train_split, val_split, check_columns(columns))


def warn_once(message: str) -> None:
    """A warning on global rank 0 only (each rank reads the same data and would repeat it)."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    if getattr(rank_zero_only, "rank", 0) == 0:
        log.warning(message)


# ---------------------------------------------------------------------------------------------
# The datamodule
# ---------------------------------------------------------------------------------------------


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
    """

    def __init__(
        self,
        train_file: str | None = None,
        val_file: str | None = None,
        tokenizer: str | None = None,
        max_length: int = 1024,
        batch_size: int | None = 8,
        max_tokens_per_batch: int | None = None,
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
        self.train_set = self._load("train")
        if self.source.has_val:
            self.val_set = self._load("val")

    def _load(self, name: str) -> TokenizedDataset:
        where = self.source.describe(name)
        examples, stats = tokenize_rows(self.source.rows(name), self.tokenizer, self.max_length)
        self.stats[name] = stats
        summary = stats.summary(f"{name} ({where})", self.max_length)
        if stats.truncated or stats.dropped:
            warn_once(summary + "; raise `data.max_length` to keep whole rows")
        else:
            log.info(summary)
        if not examples:
            raise DataFormatError(f"{where}: no usable rows after tokenization")
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
    """The conversation a policy continues: ``{"prompt": str}`` (optionally ``"system"``),
    ``{"prompt": [messages]}`` (TRL's conversational form), or ``{"messages": [...]}``, the last two
    ending in a turn that is not the assistant's."""
    where = row.get("_where", "row")
    if isinstance(row.get("prompt"), (str, list)):
        messages, field = _as_messages(row["prompt"], "user", where, "prompt"), "prompt"
        messages = _system(row, messages) + messages
    elif "messages" in row:
        messages, field = row["messages"], "messages"
        check_messages(messages, where)
    else:
        keys = sorted(k for k in row if k != "_where")
        raise DataFormatError(
            f"{where}: a prompt row needs `prompt` (a string or a list of messages) or `messages`; it has keys {keys}"
        )
    if messages[-1]["role"] == "assistant":
        raise DataFormatError(f"{where}: a prompt's `{field}` must end before the assistant's answer")
    return messages


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

    Rows have a ``prompt`` (a string, optionally with ``system``, or TRL's conversational list of
    messages) or ``messages`` ending before the assistant's turn. Other keys (``answer``...) ride
    along to the reward function.

    Args:
        train_file: a JSONL, JSON or Parquet file, or a ``datasets`` ``save_to_disk`` folder (of a
            DatasetDict, ``train_split`` is used). Exclusive with ``dataset``.
        tokenizer: model folder or hub id (the PPO recipe links it to ``model.name_or_path``).
        max_prompt_length: prompts with more tokens are dropped (counted and logged): cutting a
            prompt would change the question the reward judges.
        system_prompt: a system message for rows that bring none (e.g. "Answer with the number
            only."); None adds nothing.
        batch_size: prompts per rank per PPO step (GRPO samples ``group_size`` responses each).
        seed: shuffling seed; each epoch reshuffles deterministically from it.
        dataset: a Hugging Face hub dataset id, loaded with
            ``datasets.load_dataset(dataset, name=subset, split=train_split)``.
        subset: the hub dataset's configuration name, if it has several.
        train_split: the split to read (``"train"``).
        columns: field names of the dataset for the ones read here, e.g. ``{prompt: question}``
            (``answer: solution`` gives a reward rule its ``answer``).
    """

    def __init__(
        self,
        train_file: str | None = None,
        tokenizer: str | None = None,
        max_prompt_length: int = 512,
        batch_size: int = 8,
        system_prompt: str | None = None,
        num_workers: int = 0,
        seed: int = 0,
        dataset: str | None = None,
        subset: str | None = None,
        train_split: str = "train",
        columns: dict[str, str] | None = None,
    ) -> None:
        super().__init__()
        self.source = data_source(train_file, None, dataset, subset, train_split, None, columns)
        self.train_path = self.source.train_file
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
        where = self.source.describe("train")
        rows = self.source.rows("train")
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
        summary = (
            f"prompts ({where}): {len(rows)} rows, {len(self.dropped)} dropped as longer than"
            f" max_prompt_length={self.max_prompt_length}"
        )
        if self.dropped:
            warn_once(summary + "; raise `data.max_prompt_length` to keep them")
        else:
            log.info(summary)
        world = self.trainer.world_size if self.trainer else 1
        if len(kept) < self.batch_size * world:
            raise DataFormatError(
                f"{where}: {len(kept)} usable prompts, fewer than one step needs"
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
        prompt = row.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict) and prompt[0].get("role") != "system":
            return {**row, "prompt": [{"role": "system", "content": self.system_prompt}, *prompt]}
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
