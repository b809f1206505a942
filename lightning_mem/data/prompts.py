"""Prompt sets for RL: prompts only, kept with their rows (a reward rule reads e.g. ``answer``),
left-padded for generation, in full batches of the same size on every rank."""

from __future__ import annotations

import logging
from typing import Any

import torch
from jsonargparse.typing import PositiveInt
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset

from lightning_mem.batching import TokenBudgetSampler, resume_where_stopped
from lightning_mem.data.chat import encode_prompt, row_to_prompt_messages
from lightning_mem.data.rows import DataFormatError, data_source, warn_once
from lightning_mem.padding import pad_sequences
from lightning_mem.ranks import data_parallel
from lightning_mem.settings import SettingError, check_arguments, join_key, settings_at

log = logging.getLogger(__name__)


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
    ) -> None:
        super().__init__()
        self.source = data_source(train_file, None, dataset, subset, train_split, None, columns)
        self.train_path = self.source.train_file
        self.system_prompt = system_prompt
        # The ranges are the annotations (the CLI checks them while parsing); the same rule here.
        check_arguments(PromptDataModule.__init__, {"max_prompt_length": max_prompt_length, "batch_size": batch_size})
        if tokenizer is None:
            raise SettingError("tokenizer", " is not set: name the model folder or hub id to load it from")
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
        with settings_at(self.config_key):  # errors name data.columns... under the recipes' CLI
            self.train_set = self._load_prompts()

    def _load_prompts(self) -> PromptDataset:
        from lightning_mem.models import load_tokenizer

        self.tokenizer = load_tokenizer(self.tokenizer_name, key="tokenizer")
        where = self.source.describe("train")
        rows = self.source.rows("train")
        prompt_ids, kept = [], []
        for row in rows:
            row = self._with_system_prompt(row)
            ids = encode_prompt(row_to_prompt_messages(row), self.tokenizer)
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
            warn_once(summary + f"; raise `{join_key(self.config_key, 'max_prompt_length')}` to keep them")
        else:
            log.info(summary)
        world, _ = data_parallel(self.trainer)  # a tensor- or context-parallel group shares its prompts
        if len(kept) < self.batch_size * world:
            raise DataFormatError(
                f"{where}: {len(kept)} usable prompts, fewer than one step needs"
                f" (`{join_key(self.config_key, 'batch_size')}`={self.batch_size} x {world} ranks)"
            )
        return PromptDataset(prompt_ids, kept)

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

    def largest_batch(self, fill_token: int) -> dict[str, Any]:
        """The largest batch of prompts these settings allow, made of ``fill_token``: ``batch_size``
        prompts of ``max_prompt_length`` tokens, each with the data's first row (what a reward rule
        reads, e.g. its ``answer``). The memory estimate (:mod:`lightning_mem.estimate`) runs the recipe
        on it; only that row is read."""
        with settings_at(self.config_key):
            row = self._with_system_prompt(self.source.first_row("train"))
        ids = torch.full((self.batch_size, self.max_prompt_length), fill_token, dtype=torch.long)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "rows": [row] * self.batch_size}

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None, "call setup() first"
        trainer = self.trainer
        replicas, replica = data_parallel(trainer)  # a tensor- or context-parallel group shares its prompts
        sampler = FullBatchSampler(
            [len(p) for p in self.train_set.prompt_ids],
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
