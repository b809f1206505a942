"""The Arrow cache's readers: a list or string column's rows read chunk by chunk, equal to pyarrow's
own take, without copying the column (exact bytes from Arrow's allocator); the prompt set reads its
rows that way."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest

from lightning_mem.data.cache import KEPT, take_ragged, take_strings
from lightning_mem.data.prompts import PromptDataset


class _Table:
    """What ``take_ragged`` reads of a ``datasets.Dataset``: ``.data.table``."""

    def __init__(self, table: pa.Table) -> None:
        self.data = type("Data", (), {"table": table})()


def _chunked(rows: int, per_chunk: int) -> pa.Table:
    rng = np.random.default_rng(0)
    batches = []
    for start in range(0, rows, per_chunk):
        n = min(per_chunk, rows - start)
        lengths = rng.integers(0, 9, size=n)
        offsets = pa.array(np.concatenate(([0], np.cumsum(lengths))).astype(np.int32))
        values = pa.array(rng.integers(0, 1000, size=int(lengths.sum())).astype(np.int32))
        batches.append(pa.record_batch([pa.ListArray.from_arrays(offsets, values)], names=["ids"]))
    table = pa.Table.from_batches(batches)
    return table.slice(3, rows - 5)  # a sliced table: chunks whose offsets do not start at 0


@pytest.mark.parametrize("indices", [[0], [7, 2, 7, 401, 0], list(range(30, 90, 7)), []])
def test_rows_equal_pyarrows_take(indices):
    table = _chunked(500, 37)
    got = take_ragged(_Table(table), indices, "ids")
    expected = table.column("ids").take(pa.array(indices, type=pa.int64())).to_pylist()
    assert [g.tolist() for g in got] == expected
    assert all(g.flags.writeable and g.dtype == np.int32 for g in got)


def test_reading_rows_copies_no_column():
    """pyarrow's ChunkedArray.take concatenates the whole column first (1.6 GB per column at a
    million rows of 400 tokens, per micro-batch); reading chunk by chunk allocates nothing in
    Arrow's allocator (the rows' copy is numpy's)."""
    table = _chunked(20_000, 100)
    column_bytes = table.column("ids").nbytes
    pool = pa.proxy_memory_pool(pa.default_memory_pool())
    previous = pa.default_memory_pool()
    pa.set_memory_pool(pool)
    try:
        take_ragged(_Table(table), [5, 10_000, 19_000], "ids")
        ours = pool.max_memory()
        table.column("ids").take(pa.array([5, 10_000, 19_000]))
        theirs = pool.max_memory()
    finally:
        pa.set_memory_pool(previous)
    assert ours == 0
    assert theirs >= column_bytes // 2  # the concatenated column: why take_ragged does not use take


def _arrow_bytes(read) -> int:
    """The most bytes Arrow's allocator held while ``read()`` ran."""
    pool = pa.proxy_memory_pool(pa.default_memory_pool())
    previous = pa.default_memory_pool()
    pa.set_memory_pool(pool)
    try:
        read()
        return pool.max_memory()
    finally:
        pa.set_memory_pool(previous)


def _strings(rows: int, per_chunk: int, kind=pa.string(), nulls: bool = False) -> pa.Table:
    texts = [None if nulls and i % 11 == 3 else ("" if i % 7 == 0 else f"row {i} é " * (i % 5)) for i in range(rows)]
    batches = [pa.record_batch([pa.array(texts[s : s + per_chunk], kind)], names=["text"]) for s in range(0, rows, per_chunk)]
    return pa.Table.from_batches(batches).slice(3, rows - 5)


@pytest.mark.parametrize("kind", [pa.string(), pa.large_string()])
@pytest.mark.parametrize("indices", [[0], [7, 2, 7, 401, 0], list(range(30, 90, 7)), []])
def test_strings_equal_pyarrows_take(kind, indices):
    table = _strings(500, 37, kind, nulls=True)
    expected = table.column("text").take(pa.array(indices, type=pa.int64())).to_pylist()
    assert take_strings(_Table(table), indices, "text") == expected


def test_strings_out_of_range():
    with pytest.raises(IndexError):
        take_strings(_Table(_strings(50, 7)), [45], "text")  # 45 rows after the slice
    with pytest.raises(IndexError):
        take_strings(_Table(_strings(50, 7)), [-1], "text")


def test_reading_strings_copies_no_column():
    table = _strings(20_000, 100)
    ours = _arrow_bytes(lambda: take_strings(_Table(table), [5, 10_000, 19_000], "text"))
    theirs = _arrow_bytes(lambda: table.column("text").take(pa.array([5, 10_000, 19_000])))
    assert ours == 0
    assert theirs >= table.column("text").nbytes // 2


def _prompt_set(rows: int, per_chunk: int) -> PromptDataset:
    import datasets

    status = [KEPT if i % 9 else 1 for i in range(rows)]  # every ninth row dropped
    batches = []
    for s in range(0, rows, per_chunk):
        n = min(per_chunk, rows - s)
        ids = pa.array([[s + i] * ((s + i) % 6) for i in range(n)], pa.list_(pa.int32()))
        batches.append(pa.record_batch(
            [ids, pa.array([json.dumps({"i": s + i, "answer": str(s + i) * 20}) for i in range(n)]),
             pa.array([(s + i) % 6 for i in range(n)], pa.int32()), pa.array(status[s : s + n], pa.int8())],
            names=["prompt_ids", "row", "length", "status"]))
    return PromptDataset(datasets.Dataset(datasets.table.InMemoryTable(pa.Table.from_batches(batches))))


def test_prompt_rows_read_chunk_wise():
    """The prompt set's rows, iterated (blocks of 10,000) or batched, are the kept rows in order,
    read without a private copy of the ``row`` column (Arrow's allocator holds nothing)."""
    data = _prompt_set(25_000, 1000)
    kept = [i for i in range(25_000) if i % 9]
    rows: list = []
    assert _arrow_bytes(lambda: rows.extend(data.rows)) == 0
    assert [r["i"] for r in rows] == kept and rows[5] == data.rows[5] == {"i": kept[5], "answer": str(kept[5]) * 20}
    batch: list = []
    assert _arrow_bytes(lambda: batch.extend(data[[3, 20_000, 3]])) == 0
    assert [b["row"]["i"] for b in batch] == [kept[3], kept[20_000], kept[3]]
    assert [b["prompt_ids"].tolist() for b in batch] == [[kept[i]] * (kept[i] % 6) for i in (3, 20_000, 3)]
    whole = data.table.data.column("row").nbytes
    assert _arrow_bytes(lambda: data.table.data.column("row").take(pa.array([3]))) >= whole // 2  # what the old read cost
