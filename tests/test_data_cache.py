"""The Arrow cache's readers: a list column's rows read chunk by chunk, equal to pyarrow's own take,
without copying the column (exact bytes from Arrow's allocator)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from lightning_mem.data.cache import take_ragged


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
