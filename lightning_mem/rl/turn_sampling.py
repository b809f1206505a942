"""Sampling the turns of a batch of trajectories: each call samples one assistant turn for every
trajectory still running, from the ids it has been given so far.

Two samplers share one interface (``session(model)`` around the whole rollout, then
``sample(model, rows, new_ids, max_new_tokens)`` once per turn, ``rows`` naming the trajectories
still running, a subset in order of the previous call's):

- :class:`CachedTurns` (the ``hf`` engine with ``kv_cache: dynamic``): one ``generate`` call per
  turn on the whole batch, continuing the KV cache the previous call left, so a turn prefills only
  its new ids (the observation and the generation prompt), never the conversation again. The
  batch keeps one column layout across turns: each turn's new ids are appended flush right with
  the padding of shorter ones *inside* the new columns, masked out by the attention mask (left
  padding each turn, as a fresh batch would be laid out, cannot be: the cache's columns are
  fixed). Positions follow the attention mask (``generate`` counts them from its cumulative sum),
  so every row sees its own tokens at positions 0, 1, 2... as it would alone. Rows whose episode
  ended leave the batch (their cache rows are dropped: the batch shrinks) rather than ride along as
  padding that is computed every step.
- :class:`PrefillTurns`: any engine's ``generate`` on the whole conversation of each row, left
  padded, every turn (vLLM, which takes token-id prompts and caches prefixes itself, and the
  static decode loop, whose preallocated cache is laid out per call).

Under ``synced`` (sharded models: every forward is a collective) a rank whose trajectories have all
ended keeps calling with a one-token dummy row while other ranks sample (the rollout agrees on
the number of turns over the ranks first).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from lightning_mem.padding import pad_sequences


def until_end(ids: list[int], end_ids: set[int]) -> list[int]:
    """``ids`` up to and including the first end token (all of them if none)."""
    for j, token in enumerate(ids):
        if token in end_ids:
            return ids[: j + 1]
    return ids


class CachedTurns:
    """The ``hf`` engine across turns, continuing its KV cache (module docstring).

    ``shrink=False`` keeps the rows whose episode ended in the batch as padding (each turn gives
    them no new ids, and what they sample is dropped): what ``benchmarks/multi_turn_rollout.py``
    measures the shrinking batch against.
    """

    def __init__(self, generation: Any, *, eos_token_ids: list[int], pad_token_id: int, shrink: bool = True) -> None:
        self.generation, self.eos_token_ids, self.pad_token_id = generation, list(eos_token_ids), pad_token_id
        self.end_ids, self.shrink = set(eos_token_ids), shrink
        self._reset()

    def _reset(self) -> None:
        self.ids: Tensor | None = None
        self.mask: Tensor | None = None
        self.cache: Any = None
        self.rows: list[int] = []

    @contextlib.contextmanager
    def session(self, model: torch.nn.Module) -> Iterator[None]:
        """Around a whole rollout: dropout off, LoRA adapters merged once for every turn, the
        checkpoint's sampling settings hidden; the cache freed at the end."""
        from lightning_mem.lora import merged_adapters
        from lightning_mem.rl.sampling import checkpoint_settings_hidden

        was_training = model.training
        model.eval()
        try:
            with merged_adapters(model, enabled=self.generation.merge_lora), \
                    checkpoint_settings_hidden(model, self._settings(self.generation.max_new_tokens)):
                yield
        finally:
            model.train(was_training)
            self._reset()

    def _settings(self, max_new_tokens: int) -> Any:
        from lightning_mem.rl.sampling import hf_generation_config

        return hf_generation_config(replace(self.generation, max_new_tokens=max_new_tokens),
                                    eos_token_ids=self.eos_token_ids, pad_token_id=self.pad_token_id)

    def _layout(self, rows: list[int], new_ids: list[list[int]], device: torch.device) -> None:
        """The batch for this turn: the first turn's prompts left-padded (as a single-turn rollout
        lays them out); later, the running rows' cache and columns, the new ids appended flush right."""
        if self.ids is None:
            from transformers import DynamicCache

            self.ids, self.mask = pad_sequences(new_ids, self.pad_token_id, side="left", device=device)
            self.cache, self.rows = DynamicCache(), list(rows)
            return
        new = dict(zip(rows, new_ids))
        if self.shrink and len(rows) < len(self.rows):
            keep = torch.tensor([self.rows.index(r) for r in rows], dtype=torch.long, device=self.ids.device)
            self.ids, self.mask = self.ids[keep], self.mask[keep]
            self.cache.batch_select_indices(keep)
            self.rows = list(rows)
        # A row that ended rides along on one pad token of its own (a row of masked tokens only would
        # give its attention nothing to attend to); what it samples is dropped.
        chunk, chunk_mask = pad_sequences([new.get(r, [self.pad_token_id]) for r in self.rows], self.pad_token_id,
                                          side="left", device=self.ids.device)
        self.ids, self.mask = torch.cat([self.ids, chunk], 1), torch.cat([self.mask, chunk_mask], 1)

    @torch.no_grad()
    def sample(self, model: torch.nn.Module, rows: list[int], new_ids: list[list[int]], max_new_tokens: int, *,
               synced: bool = False) -> list[list[int]]:
        """One turn for ``rows``: each row's sampled ids up to and including its end token."""
        if not rows:
            if synced:  # the other ranks still sample: run their forward passes alongside
                dummy = torch.tensor([[self.pad_token_id]], device=device_of(model))
                model.generate(input_ids=dummy, attention_mask=torch.ones_like(dummy), synced_gpus=True,
                               generation_config=self._settings(1))
            return []
        self._layout(rows, new_ids, device_of(model))
        width = self.ids.shape[1]
        sequences = model.generate(input_ids=self.ids, attention_mask=self.mask, synced_gpus=synced,
                                   generation_config=self._settings(max_new_tokens),
                                   **{_cache_keyword(model): self.cache})
        running = set(rows)
        sampled = [until_end(ids, self.end_ids) if r in running else [] for r, ids in
                   zip(self.rows, sequences[:, width:].tolist())]
        # What follows a row's end token is filler generate wrote while other rows went on: masked out.
        keep = torch.zeros(sequences.shape[0], sequences.shape[1] - width, dtype=self.mask.dtype, device=self.mask.device)
        for i, ids in enumerate(sampled):
            keep[i, : len(ids)] = 1
        self.ids, self.mask = sequences, torch.cat([self.mask, keep], 1)
        by_row = dict(zip(self.rows, sampled))
        return [by_row[r] for r in rows]


class PrefillTurns:
    """Any engine's ``generate`` on each row's whole conversation, every turn (module docstring)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.end_ids = set(engine.eos_token_ids)
        self.sequences: dict[int, list[int]] = {}
        # The engine's log-probs of the ids the last call returned (None if it reports none).
        self.last_logprobs: list[list[float]] | None = None

    @contextlib.contextmanager
    def session(self, model: torch.nn.Module) -> Iterator[None]:
        try:
            yield
        finally:
            self.sequences = {}

    @torch.no_grad()
    def sample(self, model: torch.nn.Module, rows: list[int], new_ids: list[list[int]], max_new_tokens: int, *,
               synced: bool = False) -> list[list[int]]:
        if not rows and not synced:
            return []
        for r, ids in zip(rows, new_ids):
            self.sequences[r] = self.sequences.get(r, []) + list(ids)
        prompts = [self.sequences[r] for r in rows] or [[self.engine.pad_token_id]]
        ids, mask = pad_sequences(prompts, self.engine.pad_token_id, side="left", device=device_of(model))
        config = self.engine.config
        self.engine.config = replace(config, max_new_tokens=max_new_tokens if rows else 1)
        try:
            exp = self.engine.generate(model, ids, mask, synced=synced)
        finally:
            self.engine.config = config
        lengths = exp.response_lengths.tolist()
        sampled = [exp.response_ids[i, :n].tolist() for i, n in enumerate(lengths)][: len(rows)]
        self.last_logprobs = None if exp.engine_logprobs is None else [
            exp.engine_logprobs[i, :n].tolist() for i, n in enumerate(lengths)][: len(rows)]
        for r, ids_r in zip(rows, sampled):
            self.sequences[r] += ids_r
        return sampled


def device_of(model: torch.nn.Module | None) -> torch.device:
    """Where a batch for ``model`` goes; the CPU for an engine that holds the weights itself (vLLM's
    generator has no model of ours)."""
    return next(model.parameters()).device if model is not None else torch.device("cpu")


def _cache_keyword(model: torch.nn.Module) -> str:
    """``generate``'s name for a cache to continue: ``cache`` in the transformers versions whose
    models' forward takes it (it replaced ``past_key_values``), else ``past_key_values``."""
    import inspect

    from transformers import PreTrainedModel

    inner = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), model)  # under a peft wrapper
    return "cache" if "cache" in inspect.signature(inner.forward).parameters else "past_key_values"
