"""Preference rows: their shapes, the checks that name a bad row, and their tokenization into the
Arrow cache's columns (each side exactly as an SFT prompt/completion row is tokenized).

Row shapes (mixed freely in one file; ``data.columns`` renames fields, as for SFT):

1. ``{"prompt": str, "chosen": str, "rejected": str}``;
2. ``{"prompt": [messages], "chosen": [messages], "rejected": [messages]}`` (TRL's conversational
   preference format: the completions hold the assistant turn(s));
3. ``{"chosen": [messages], "rejected": [messages]}``: whole conversations whose longest common
   prefix of messages is the prompt, the rest the completions;
4. any of them with ``"system"`` (as SFT rows) and a numeric ``"margin"`` (a reward model's).

Truncation: each side (prompt + that completion) keeps its first ``max_length`` tokens. A pair
either of whose sides keeps no completion token to score, or whose two sides are identical after
the cut, is dropped; both are counted (:class:`PairStats`) and reported in one warning.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from numbers import Real
from typing import Any

import numpy as np

from lightning_mem.data.cache import BLANK, DROPPED, KEPT, parse_rows
from lightning_mem.data.chat import as_messages, encode_rendered, render_with_spans, with_system
from lightning_mem.data.rows import DataFormatError
from lightning_mem.data.sft import IGNORE_INDEX, span_labels

#: ``status`` of a pair dropped because its two sides became identical under the cut (beside the
#: cache's KEPT, DROPPED -- a side with no completion token left -- and BLANK).
IDENTICAL = 3

SIDES = ("chosen", "rejected")


@dataclass
class PairStats:
    """What truncation did to a preference set, reported in one warning."""

    rows: int = 0
    truncated: int = 0
    dropped: int = 0
    identical: int = 0
    dropped_where: list[str] = field(default_factory=list)

    def summary(self, name: str, max_length: int) -> str:
        return (
            f"{name}: {self.rows} pairs, {self.truncated} with a side truncated to max_length={max_length},"
            f" {self.dropped + self.identical} dropped ({self.dropped} with a side left without completion tokens,"
            f" {self.identical} whose sides became identical)"
        )


def _completion(value: Any, where: str, side: str) -> list[dict[str, str]]:
    """A side's completion as messages: a string is one assistant turn; it must hold an assistant
    turn, and no assistant turn of it may be empty."""
    if isinstance(value, str) and not value.strip():
        raise DataFormatError(f"{where}: `{side}` is an empty completion")
    messages = as_messages(value, "assistant", where, side)
    assistant = [m for m in messages if m["role"] == "assistant"]
    if not assistant:
        raise DataFormatError(f"{where}: `{side}` has no assistant turn to score")
    if any(not m["content"].strip() for m in assistant):
        raise DataFormatError(f"{where}: `{side}` has an assistant turn with empty content")
    return messages


def _common_prefix(chosen: list[dict[str, str]], rejected: list[dict[str, str]]) -> int:
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    return n


def row_to_pair(row: dict[str, Any]) -> tuple[list[dict[str, str]], list[dict[str, str]], list[dict[str, str]], float]:
    """``(prompt, chosen, rejected, margin)``: the prompt's messages (with the row's ``system``),
    each side's completion messages, and the row's ``margin`` (0.0 without one). Raises a
    :class:`DataFormatError` naming the row's file and line."""
    where = row.get("_where", "row")
    keys = sorted(k for k in row if k != "_where")
    if "chosen" not in row or "rejected" not in row:
        raise DataFormatError(
            f"{where}: a preference row needs `chosen` and `rejected` (and `prompt`, unless both are whole"
            f" conversations); it has keys {keys}"
        )
    chosen, rejected = row["chosen"], row["rejected"]
    if "prompt" in row:
        if not isinstance(row["prompt"], (str, list)):
            raise DataFormatError(f"{where}: `prompt` must be a string or a list of messages, got {type(row['prompt']).__name__}")
        prompt = as_messages(row["prompt"], "user", where, "prompt")
        chosen, rejected = (_completion(v, where, side) for v, side in ((chosen, "chosen"), (rejected, "rejected")))
    else:
        if not (isinstance(chosen, list) and isinstance(rejected, list)):
            raise DataFormatError(
                f"{where}: without `prompt`, `chosen` and `rejected` must be whole conversations (lists of"
                f" messages) sharing their prompt; it has keys {keys}"
            )
        for value, side in ((chosen, "chosen"), (rejected, "rejected")):
            as_messages(value, "assistant", where, side)  # the messages' own checks
        if chosen == rejected:
            raise DataFormatError(f"{where}: `chosen` equals `rejected`: a pair must differ")
        shared = _common_prefix(chosen, rejected)
        if shared == 0:
            raise DataFormatError(
                f"{where}: `chosen` and `rejected` share no first message: a row without `prompt` takes their"
                " common prefix as its prompt"
            )
        prompt = chosen[:shared]
        chosen, rejected = (_completion(v[shared:] or "", where, side) for v, side in ((chosen, "chosen"), (rejected, "rejected")))
    if chosen == rejected:
        raise DataFormatError(f"{where}: `chosen` equals `rejected`: a pair must differ")
    margin = row.get("margin", 0.0)
    if margin is None:
        margin = 0.0
    if isinstance(margin, bool) or not isinstance(margin, Real) or not math.isfinite(margin):
        raise DataFormatError(f"{where}: `margin` must be a finite number, got {margin!r}")
    return with_system(row, prompt) + prompt, chosen, rejected, float(margin)


def tokenize_pair_batch(
    batch: dict[str, list[Any]], indices: list[int], *, tokenizer: Any, max_length: int, jsonl: str, columns: dict[str, str] | None
) -> dict[str, list[Any]]:
    """``datasets.map`` function: raw rows (:func:`~lightning_mem.data.cache.raw_rows`) to the cached
    pair columns, one output row per input row. Each side is rendered and labelled exactly as an SFT
    prompt/completion row (:func:`~lightning_mem.data.chat.render_with_spans` from the completion's
    first message, :func:`~lightning_mem.data.sft.span_labels`), then cut to ``max_length``.

    ``<side>_targets`` counts the side's labels that a previous token predicts (what its log-prob
    sums over); ``status`` marks dropped pairs and blank lines, so that the counts and the rows'
    names come from the columns afterwards, whatever process tokenized them."""
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError("a fast (Rust) tokenizer is required: loss masking uses its offset mapping")
    rows = parse_rows(batch["line"], indices, jsonl, columns)
    texts, spans, pairs = [], [], []
    for row in rows:
        if row is not None:
            prompt, chosen, rejected, margin = row_to_pair(row)
            for completion in (chosen, rejected):
                text, side_spans = render_with_spans(prompt + completion, tokenizer, len(prompt))
                texts.append(text)
                spans.append(side_spans)
            pairs.append((row["_where"], margin))
    encoded = encode_rendered(texts, tokenizer, return_offsets_mapping=True) if texts else {"input_ids": [], "offset_mapping": []}
    out: dict[str, list[Any]] = {k: [] for k in _COLUMNS}
    sides = iter(zip(encoded["input_ids"], encoded["offset_mapping"], spans))
    done = iter(pairs)
    empty = np.zeros(0, dtype=np.int32)
    for row in rows:
        if row is None:
            values: dict[str, Any] = {f"{s}_{k}": v for s in SIDES for k, v in (("ids", empty), ("labels", empty), ("length", 0), ("targets", 0))}
            values.update(margin=0.0, truncated=False, status=BLANK, where="")
        else:
            where, margin = next(done)
            values, truncated = {}, False
            for side in SIDES:
                ids, offsets, side_spans = next(sides)
                labels = span_labels(ids, offsets, side_spans)[:max_length]
                truncated |= len(ids) > max_length
                values.update({f"{side}_ids": np.asarray(ids[:max_length], dtype=np.int32), f"{side}_labels": labels,
                               f"{side}_length": len(labels), f"{side}_targets": int((labels[1:] != IGNORE_INDEX).sum())})
            values.update(margin=margin, truncated=truncated, status=_status(values), where=where)
        for k in out:
            out[k].append(values[k])
    return out


def _status(values: dict[str, Any]) -> int:
    if not (values["chosen_targets"] and values["rejected_targets"]):
        return DROPPED
    same = all(np.array_equal(values[f"chosen_{k}"], values[f"rejected_{k}"]) for k in ("ids", "labels"))
    return IDENTICAL if same else KEPT


_COLUMNS = (*(f"{s}_{k}" for s in SIDES for k in ("ids", "labels", "length", "targets")), "margin", "truncated", "status", "where")


def pair_features() -> Any:
    """The cached columns' Arrow types."""
    import datasets

    ids, number = datasets.List(datasets.Value("int32")), datasets.Value("int32")
    sides = {f"{s}_{k}": (ids if k in ("ids", "labels") else number) for s in SIDES for k in ("ids", "labels", "length", "targets")}
    return datasets.Features(
        {**sides, "margin": datasets.Value("float32"), "truncated": datasets.Value("bool"),
         "status": datasets.Value("int8"), "where": datasets.Value("string")}
    )
