"""Prompt sets for RL: prompts only, kept with their rows (a reward rule reads e.g. ``answer``),
left-padded for generation, in full batches of the same size on every rank."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

import torch
from jsonargparse.typing import PositiveInt
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset

from lightning_mem.batching import BatchPlan, TokenBudgetSampler, resume_where_stopped
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
from lightning_mem.data.chat import encode_rendered, render_prompt, row_to_prompt_messages
from lightning_mem.data.rows import DataFormatError, data_source, warn_once
from lightning_mem.padding import pad_sequences
from lightning_mem.ranks import data_parallel
from lightning_mem.settings import SettingError, check_arguments, join_key, settings_at

log = logging.getLogger(__name__)


def with_system_prompt(row: dict[str, Any], system_prompt: str | None) -> dict[str, Any]:
    """``row`` with ``system_prompt`` as its system message, unless it brings its own.

    Written into the row, so that whatever rebuilds the conversation from it later (a reward
    model) sees the same system message as the policy."""
    if not system_prompt:
        return row
    if isinstance(row.get("prompt"), str):
        return row if row.get("system") else {**row, "system": system_prompt}
    prompt = row.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict) and prompt[0].get("role") != "system":
        return {**row, "prompt": [{"role": "system", "content": system_prompt}, *prompt]}
    messages = row.get("messages")
    if isinstance(messages, list) and messages and isinstance(messages[0], dict) and messages[0].get("role") != "system":
        return {**row, "messages": [{"role": "system", "content": system_prompt}, *messages]}
    return row


def tokenize_prompt_batch(
    batch: dict[str, list[Any]], indices: list[int], *, tokenizer: Any, max_prompt_length: int, system_prompt: str | None,
    jsonl: str, columns: dict[str, str] | None,
) -> dict[str, list[Any]]:
    """``datasets.map`` function: raw rows to the cached prompt columns (the ids of
    :func:`~lightning_mem.data.chat.encode_prompt`, and the row as JSON for the reward), one output
    row per input row; ``status`` marks prompts over ``max_prompt_length`` and blank lines; ``keys``
    is the row's sorted keys as JSON (a few distinct values in a set: :func:`key_sets`)."""
    rows = [None if r is None else with_system_prompt(r, system_prompt) for r in parse_rows(batch["line"], indices, jsonl, columns)]
    texts = [render_prompt(row_to_prompt_messages(r), tokenizer) for r in rows if r is not None]
    encoded = iter(encode_rendered(texts, tokenizer)["input_ids"] if texts else [])
    out: dict[str, list[Any]] = {"prompt_ids": [], "row": [], "length": [], "status": [], "where": [], "keys": []}
    for row in rows:
        if row is None:
            values = (np.zeros(0, dtype=np.int32), "", 0, BLANK, "", "")
        else:
            ids = np.asarray(next(encoded), dtype=np.int32)
            status = DROPPED if len(ids) > max_prompt_length else KEPT
            values = (ids, json.dumps(row), len(ids), status, row["_where"], json.dumps(sorted(row)))
        for k, v in zip(out, values):
            out[k].append(v)
    return out


def _features() -> Any:
    import datasets

    return datasets.Features(
        {"prompt_ids": datasets.List(datasets.Value("int32")), "row": datasets.Value("string"), "length": datasets.Value("int32"),
         "status": datasets.Value("int8"), "where": datasets.Value("string"), "keys": datasets.Value("string")}
    )


def key_sets(mapped: Any) -> list[list[Any]]:
    """Each distinct set of keys among the kept rows: ``[keys, rows with it, first row's where]``,
    in the order of their first rows. Computed once, when the cache is built, chunk by chunk, so that a start
    checks a reward's keys against a few sets rather than parsing every row's JSON (at ten million
    rows, minutes on every rank, at every start)."""
    import pyarrow.compute as pc

    table = mapped.data.table
    counts: dict[str, list[Any]] = {}
    start = 0
    for keys, status in zip(table.column("keys").chunks, table.column("status").chunks):
        kept = keys.filter(pc.equal(status, KEPT))
        for entry in pc.value_counts(kept).to_pylist():
            value, n = entry["values"], entry["counts"]
            if value not in counts:
                here = np.logical_and(status.to_numpy(zero_copy_only=False) == KEPT, pc.equal(keys, value).to_numpy(zero_copy_only=False))
                counts[value] = [json.loads(value), 0, start + int(np.flatnonzero(here)[0])]
            counts[value][1] += n
        start += len(keys)
    ordered = sorted(counts.values(), key=lambda c: c[2])  # by each set's first row
    wheres = take_strings(mapped, [c[2] for c in ordered], "where")
    return [[keys, n, where] for (keys, n, _), where in zip(ordered, wheres)]


class _Rows(Sequence):
    """The kept prompts' data rows, decoded from the cache's JSON when read (a reward rule's
    ``answer``...); a million rows stay on disk until someone iterates them."""

    def __init__(self, table: Any, positions: np.ndarray) -> None:
        self.table, self.positions = table, positions

    def __len__(self) -> int:
        return len(self.positions)

    def __getitem__(self, idx: Any) -> Any:
        if isinstance(idx, slice):
            return [self[i] for i in range(*idx.indices(len(self)))]
        return json.loads(self.table.data.column("row")[int(self.positions[idx])].as_py())

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for start in range(0, len(self.positions), 10_000):  # chunk-wise: no private copy of the column
            for text in take_strings(self.table, self.positions[start : start + 10_000], "row"):
                yield json.loads(text)


class PromptDataset(Dataset):
    """Tokenized prompts and their rows, memory-mapped from the Arrow cache; indexing with a list
    returns a list (for batch samplers). ``lengths`` is an int32 array, one entry per prompt."""

    def __init__(self, table: Any) -> None:
        self.table = table
        self.positions = narrow_index(np.flatnonzero(column(table, "status") == KEPT))  # 4 bytes a row
        self.lengths: np.ndarray = column(table, "length")[self.positions]
        self.rows = _Rows(table, self.positions)

    def __len__(self) -> int:
        return len(self.positions)

    def __getitem__(self, idx: int | list[int]) -> Any:
        if isinstance(idx, list):
            positions = self.positions[np.asarray(idx, dtype=np.int64)]
            ids = take_ragged(self.table, positions, "prompt_ids")
            rows = take_strings(self.table, positions, "row")
            return [{"prompt_ids": i, "row": json.loads(r)} for i, r in zip(ids, rows)]
        if not -len(self) <= idx < len(self):
            raise IndexError(idx)
        return self[[idx % len(self)]][0]


def collate_left_padded(items: list[dict[str, Any]], pad_token_id: int) -> dict[str, Any]:
    """Prompts padded on the left, so that generation continues every row from the same column."""
    input_ids, attention_mask = pad_sequences([item["prompt_ids"] for item in items], pad_token_id, side="left")
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

    def _plan(self) -> BatchPlan:
        order = self._order()
        full = len(order) // self.batch_size * self.batch_size
        count = full // self.batch_size
        count -= count % self.num_replicas
        return BatchPlan(order[: count * self.batch_size], np.arange(count + 1, dtype=np.int64) * self.batch_size)


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
        num_proc: processes that tokenize when the cache is built (``datasets.map``'s ``num_proc``).
        cache_dir: where tokenized prompt sets are cached; None: ``.lightning_mem_cache`` next to
            ``train_file`` (see :func:`~lightning_mem.data.cache.default_cache_root`). Built once by
            ``prepare_data`` (local rank 0), memory-mapped by every rank, reused by later starts.

    Errors name the arguments (``batch_size``), under :attr:`config_key` when it is set.
    """

    #: Where a config holds this module's arguments (the recipes' CLI sets ``"data"``), so that
    #: errors raised while reading name ``data.columns.answer``; empty: the argument alone.
    config_key: str = ""

    def __init__(
        self,
        train_file: str | None = None,
        tokenizer: str | None = None,
        max_prompt_length: PositiveInt = 512,
        batch_size: PositiveInt = 8,
        system_prompt: str | None = None,
        num_workers: int = 0,
        seed: int = 0,
        dataset: str | None = None,
        subset: str | None = None,
        train_split: str = "train",
        columns: dict[str, str] | None = None,
        num_proc: PositiveInt = 1,
        cache_dir: str | None = None,
    ) -> None:
        super().__init__()
        self.source = data_source(train_file, None, dataset, subset, train_split, None, columns)
        self.train_path = self.source.train_file
        self.system_prompt = system_prompt
        # The ranges are the annotations (the CLI checks them while parsing); the same rule here.
        check_arguments(PromptDataModule.__init__, {"max_prompt_length": max_prompt_length, "batch_size": batch_size, "num_proc": num_proc})
        if tokenizer is None:
            raise SettingError("tokenizer", " is not set: name the model folder or hub id to load it from")
        self.tokenizer_name = tokenizer
        self.max_prompt_length = max_prompt_length
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.seed = seed
        self.num_proc = num_proc
        self.cache_root = Path(cache_dir).expanduser() if cache_dir else default_cache_root(self.source)
        self.tokenizer: Any = None
        self.train_set: PromptDataset | None = None
        self.dropped: list[str] = []
        #: The kept rows' distinct key sets, ``[keys, rows, first row's where]`` (:func:`key_sets`):
        #: what a reward's keys are checked against at the start, without reading the rows.
        self.key_sets: list[list[Any]] | None = None

    def prepare_data(self) -> None:
        # Lightning calls this on each node's local rank 0 before any rank's setup: the prompts
        # are tokenized once while the other ranks wait (see lightning_mem.data.cache).
        with settings_at(self.config_key):
            self._load_tokenizer()
            self._cached()

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        with settings_at(self.config_key):  # errors name data.columns... under the recipes' CLI
            self.train_set = self._load_prompts()

    def _load_tokenizer(self) -> None:
        from lightning_mem.models import load_tokenizer

        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(self.tokenizer_name, key="tokenizer")

    def cache_folder(self) -> Path:
        """The cache folder of the prompt set under these settings."""
        parts = ["prompts", source_identity(self.source, "train"), tokenizer_identity(self.tokenizer),
                 self.max_prompt_length, self.system_prompt, code_version(tokenize_prompt_batch, encode_rendered)]
        return self.cache_root / f"prompts-{cache_key(parts)}"

    def _cached(self) -> tuple[Path, dict[str, Any]]:
        folder = self.cache_folder()
        return folder, build_once(folder, lambda tmp: self._build(tmp, folder.name))

    def _build(self, folder: Path, key: str) -> dict[str, Any]:
        log.info(f"tokenizing prompts ({self.source.describe('train')}) into {folder.parent} with {self.num_proc} process(es)")
        raw, jsonl = raw_rows(self.source, "train", folder)
        meta: dict[str, Any] = {"files": [], "rows": 0, "dropped_where": [], "key_sets": []}
        if len(raw):
            function = partial(tokenize_prompt_batch, tokenizer=self.tokenizer, max_prompt_length=self.max_prompt_length,
                               system_prompt=self.system_prompt, jsonl=jsonl, columns=self.source.columns)
            mapped = map_rows(raw, function, folder, num_proc=self.num_proc, features=_features(), key=key, desc="tokenizing prompts")
            status = column(mapped, "status")
            dropped = np.flatnonzero(status == DROPPED)
            meta = {"files": arrow_files(mapped), "rows": int((status != BLANK).sum()),
                    "dropped_where": take_strings(mapped, dropped, "where"), "key_sets": key_sets(mapped)}
        del raw
        for f in folder.glob("raw-*.arrow"):
            f.unlink()
        return meta

    def _load_prompts(self) -> PromptDataset:
        self._load_tokenizer()
        where = self.source.describe("train")
        folder, meta = self._cached()
        self.dropped = list(meta["dropped_where"])
        self.key_sets = meta["key_sets"]
        summary = (
            f"prompts ({where}): {meta['rows']} rows, {len(self.dropped)} dropped as longer than"
            f" max_prompt_length={self.max_prompt_length}"
        )
        if self.dropped:
            warn_once(summary + f"; raise `{join_key(self.config_key, 'max_prompt_length')}` to keep them")
        else:
            log.info(summary)
        world, _ = data_parallel(self.trainer)  # a tensor- or context-parallel group shares its prompts
        kept = meta["rows"] - len(self.dropped)
        if kept < self.batch_size * world:
            raise DataFormatError(
                f"{where}: {kept} usable prompts, fewer than one step needs"
                f" (`{join_key(self.config_key, 'batch_size')}`={self.batch_size} x {world} ranks)"
            )
        return PromptDataset(open_arrow(folder, meta["files"]))

    def _with_system_prompt(self, row: dict[str, Any]) -> dict[str, Any]:
        return with_system_prompt(row, self.system_prompt)

    def largest_batch(self, fill_token: int, context_parallel_size: int = 1) -> dict[str, Any]:
        """The largest batch of prompts these settings allow, made of ``fill_token``: ``batch_size``
        prompts of ``max_prompt_length`` tokens, each with the data's first row (what a reward rule
        reads, e.g. its ``answer``). The memory estimate (:mod:`lightning_mem.estimate`) runs the recipe
        on it; only that row is read. Every rank of a context-parallel group reads the same whole
        prompts: ``context_parallel_size`` changes nothing here (the recipe's budgets count it)."""
        with settings_at(self.config_key):
            row = self._with_system_prompt(self.source.first_row("train"))
        ids = torch.full((self.batch_size, self.max_prompt_length), fill_token, dtype=torch.long)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "rows": [row] * self.batch_size}

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None, "call setup() first"
        trainer = self.trainer
        replicas, replica = data_parallel(trainer)  # a tensor- or context-parallel group shares its prompts
        sampler = FullBatchSampler(
            self.train_set.lengths,
            batch_size=self.batch_size,
            num_replicas=replicas,
            rank=replica,
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
