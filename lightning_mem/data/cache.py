"""Tokenized data sets cached on disk as Arrow, built once and memory-mapped by every rank.

Tokenizing in every rank's ``setup``, into Python lists, at every start costs minutes and
gigabytes per rank at a million rows (a Python int per token). Instead the rows go through
``datasets``' ``map`` (batched, ``num_proc`` processes) into Arrow files of int32 token ids, in a
folder named by a hash of everything the tokens depend on (:func:`cache_key`). The first process
to get there builds the folder under a file lock (Lightning runs ``prepare_data`` on each node's
local rank 0 before the other ranks call ``setup``; the lock also covers several nodes on a
shared file system, and ``setup`` called without ``prepare_data``); the others wait, then all
memory-map the same files: the page cache holds one copy per machine, whatever the rank count.

A folder is complete once ``meta.json`` is in it: a build writes into a temporary folder and
renames it, so a killed build leaves nothing that a later start would trust.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from lightning_mem.data.rows import DataFormatError, DataSource, decode_utf8, row_record, rename_columns

log = logging.getLogger(__name__)

#: Bumped when the layout of a cache folder changes (columns, meta.json); the tokenization code's
#: own source is hashed into the key as well (:func:`code_version`).
CACHE_FORMAT = 1

#: ``status`` column values: a kept example, a row with nothing left to learn or too long (counted
#: and named in the warning), and a blank line of a JSONL file (not a row at all).
KEPT, DROPPED, BLANK = 0, 1, 2

_META = "meta.json"
_BLOCK_BYTES = 64 << 20  # JSONL is read in blocks of this size: memory stays flat whatever the file size


def default_cache_root(source: DataSource) -> Path:
    """Where tokenized sets go when ``cache_dir`` is not set: a ``.lightning_mem_cache`` folder next
    to the training data (the place a user looks for it, on the same shared file system as the
    data, deleted with it); for a hub dataset, beside ``datasets``' own cache. A read-only data
    folder falls back to ``$XDG_CACHE_HOME/lightning_mem`` (``~/.cache/lightning_mem``)."""
    if source.train_file is not None:
        folder = source.train_file.resolve().parent
        if os.access(folder, os.W_OK):
            return folder / ".lightning_mem_cache"
    else:
        import datasets

        hf = Path(datasets.config.HF_DATASETS_CACHE)
        if hf.exists() and os.access(hf, os.W_OK):
            return hf / "lightning_mem_tokenized"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "lightning_mem" / "tokenized"


def _file_identity(path: Path) -> list[Any]:
    # Size and modification time, as make and `datasets` itself judge local files: hashing the
    # content of a 60 GB set would cost as much as tokenizing it.
    if path.is_dir():
        return [[str(p.relative_to(path)), p.stat().st_size, p.stat().st_mtime_ns] for p in sorted(path.rglob("*")) if p.is_file()]
    st = path.stat()
    return [str(path.resolve()), st.st_size, st.st_mtime_ns]


def source_identity(source: DataSource, which: str) -> list[Any]:
    """What identifies the rows of ``which`` (``"train"``/``"val"``) without reading them."""
    path = source.train_file if which == "train" else source.val_file
    split = source.train_split if which == "train" else source.val_split
    if path is None and which == "val" and source.val_split is not None:
        path = source.train_file
    if path is not None:
        return ["file", _file_identity(path), split if path.is_dir() else None, source.columns]
    # The loaded split's fingerprint, which `datasets` derives from the downloaded files: a new
    # revision of the hub dataset is a new cache.
    return ["hub", source.dataset, source.subset, split, source.hub_split(split)._fingerprint, source.columns]


def tokenizer_identity(tokenizer: Any) -> list[Any]:
    """The tokenizer's whole definition (vocabulary, merges, normalizer, post-processor) and chat
    template, so that a changed tokenizer file or template is a different cache."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    definition = backend.to_str() if backend is not None else repr(tokenizer)
    return [
        type(tokenizer).__name__,
        hashlib.sha256(definition.encode()).hexdigest(),
        getattr(tokenizer, "chat_template", None),
        [getattr(tokenizer, n, None) for n in ("bos_token", "eos_token", "pad_token", "unk_token")],
    ]


def code_version(*functions: Callable[..., Any]) -> str:
    """A hash of the source of the modules defining ``functions`` (and this one): any change to the
    tokenization code makes new caches rather than trusting tokens the old code wrote."""
    h = hashlib.sha256(str(CACHE_FORMAT).encode())
    modules = sorted({inspect.getmodule(f).__file__ for f in functions} | {__file__})  # type: ignore[union-attr]
    for m in modules:
        h.update(Path(m).read_bytes())
    return h.hexdigest()[:16]


def cache_key(parts: Any) -> str:
    """A short hash of ``parts`` (JSON-serialisable): the cache folder's name."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


# ---------------------------------------------------------------------------------------------
# Raw rows into Arrow, before tokenization
# ---------------------------------------------------------------------------------------------


def _jsonl_lines(path: Path) -> Iterator[list[bytes]]:
    """The lines of a JSONL file in blocks (``\\n`` only, like the line numbers people see in an
    editor), bytes undecoded: a bad byte is reported with its line by the tokenizing step."""
    rest = b""
    with path.open("rb") as f:
        while block := f.read(_BLOCK_BYTES):
            lines = (rest + block).split(b"\n")
            rest = lines.pop()
            yield lines
    if rest:
        yield [rest]


def raw_rows(source: DataSource, which: str, folder: Path) -> tuple[Any, str]:
    """The rows of ``which`` as a ``datasets.Dataset`` with one ``line`` column (JSON bytes), and
    the JSONL file whose lines they are (a row's line number is its index + 1), or ``""`` when
    each row's JSON carries its own ``_where``.

    A JSONL file is copied line by line into Arrow without being parsed (memory stays flat);
    other formats are read whole by :meth:`DataSource.rows` once, on the building process.
    """
    import datasets
    import pyarrow as pa

    out = folder / f"raw-{which}.arrow"
    schema = pa.schema([("line", pa.binary())])
    path = source.train_file if which == "train" else (source.val_file or source.train_file)
    jsonl = path is not None and path.is_file() and path.suffix == ".jsonl" and (which == "train" or source.val_file is not None)
    with pa.OSFile(str(out), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        if jsonl:
            for lines in _jsonl_lines(path):
                writer.write_batch(pa.record_batch([pa.array(lines, pa.binary())], schema=schema))
        else:
            rows = source.rows(which)
            for start in range(0, len(rows), 10_000):
                chunk = [json.dumps(r, default=str).encode() for r in rows[start : start + 10_000]]
                writer.write_batch(pa.record_batch([pa.array(chunk, pa.binary())], schema=schema))
    return datasets.Dataset.from_file(str(out)), str(path) if jsonl else ""


def parse_rows(lines: list[bytes], indices: list[int], jsonl: str, columns: dict[str, str] | None) -> list[dict[str, Any] | None]:
    """Rows from :func:`raw_rows`'s ``line`` column (None for a blank JSONL line), each with its
    ``_where``; an undecodable or malformed line is a :class:`DataFormatError` naming it."""
    rows: list[dict[str, Any] | None] = []
    for raw, idx in zip(lines, indices):
        if jsonl:
            name = f"{jsonl}:{idx + 1}"
            text = decode_utf8(raw, Path(jsonl), idx)
            if not text.strip():
                rows.append(None)
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as err:
                raise DataFormatError(f"{name}: not valid JSON ({err.msg})") from None
            row = rename_columns([row_record(row, name)], columns)[0]
        else:
            row = json.loads(raw)  # written by DataSource.rows: columns already renamed
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------
# Build once, under a lock; open memory-mapped
# ---------------------------------------------------------------------------------------------


def built(folder: Path) -> bool:
    return (folder / _META).is_file()


def build_once(folder: Path, build: Callable[[Path], dict[str, Any]]) -> dict[str, Any]:
    """``folder``'s metadata, building it first with ``build(tmp_folder) -> meta`` unless a finished
    build is there. One process builds (a file lock beside the folder); the others wait for it."""
    from filelock import FileLock

    if not built(folder):
        folder.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(folder) + ".lock"):
            if not built(folder):  # another process may have built it while we waited
                tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()
                try:
                    meta = build(tmp)
                    (tmp / _META).write_text(json.dumps(meta))
                    shutil.rmtree(folder, ignore_errors=True)
                    tmp.rename(folder)
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
    return json.loads((folder / _META).read_text())


def arrow_files(dataset: Any) -> list[str]:
    """The names of the Arrow files that hold ``dataset`` (a :func:`map_rows` output, in the build
    folder: one per process), in row order, for :func:`open_arrow`."""
    return [Path(f["filename"]).name for f in dataset.cache_files]


def open_arrow(folder: Path, files: Iterable[str]) -> Any:
    """The cached files as one memory-mapped ``datasets.Dataset`` (nothing is read into memory)."""
    import datasets

    parts = [datasets.Dataset.from_file(str(folder / f)) for f in files]
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def map_rows(raw: Any, function: Callable[..., dict[str, Any]], folder: Path, *, num_proc: int | None, features: Any, key: str, desc: str) -> Any:
    """``raw.map(function)`` in batches over ``num_proc`` processes, written into ``folder``."""
    return raw.map(
        function,
        batched=True,
        batch_size=1000,
        with_indices=True,
        remove_columns=raw.column_names,
        features=features,
        num_proc=num_proc if num_proc and num_proc > 1 else None,
        cache_file_name=str(folder / "tokens.arrow"),
        new_fingerprint=key,  # our key: hashing the function would pickle the whole tokenizer
        desc=desc,
    )


def column(dataset: Any, name: str) -> np.ndarray:
    """One fixed-width column as a numpy array, straight from Arrow (no Python objects per row)."""
    return dataset.data.column(name).to_numpy()


def _chunks_of(dataset: Any, indices: Any, name: str) -> tuple[list[Any], np.ndarray, np.ndarray]:
    """The chunks of column ``name``, and for each of ``indices`` its chunk and its row in it."""
    chunks = dataset.data.table.column(name).chunks
    starts = np.concatenate(([0], np.cumsum(np.fromiter((len(c) for c in chunks), dtype=np.int64, count=len(chunks)))))
    rows = np.asarray(indices, dtype=np.int64).reshape(-1)
    if len(rows) and (rows.min() < 0 or rows.max() >= starts[-1]):
        raise IndexError(f"rows {rows.min()}..{rows.max()} of a column of {starts[-1]}")
    which = np.searchsorted(starts, rows, side="right") - 1
    return chunks, which, rows - starts[which]


def take_ragged(dataset: Any, indices: Any, name: str) -> list[np.ndarray]:
    """The rows ``indices`` of a list column, as numpy arrays (views of one private buffer).

    Each row is read from its own chunk of the memory-mapped table: only its pages are touched.
    (pyarrow's ``ChunkedArray.take`` concatenates every chunk of the column first: at a million
    rows of 400 tokens a 1.6 GB private copy per column, per micro-batch, which was most of the
    3.65 GB peak RSS a rank reached at 1M rows, docs/benchmarks.md.)
    """
    chunks, which, local = _chunks_of(dataset, indices, name)
    pieces = []
    for k, row in zip(which.tolist(), local.tolist()):
        chunk = chunks[k]
        lo, hi = chunk.offsets[row].as_py(), chunk.offsets[row + 1].as_py()  # into the unsliced values
        pieces.append(chunk.values.slice(lo, hi - lo).to_numpy(zero_copy_only=False))
    if not pieces:
        return []
    # A copy (one micro-batch's tokens): Arrow's buffers are read-only, and torch refuses to wrap those.
    values = np.concatenate(pieces)
    ends = np.cumsum([len(piece) for piece in pieces])
    return [values[end - len(piece) : end] for piece, end in zip(pieces, ends)]


def take_strings(dataset: Any, indices: Any, name: str) -> list[str | None]:
    """The rows ``indices`` of a string column as ``str`` (None for a null): what
    ``ChunkedArray.take(indices).to_pylist()`` gives, read as :func:`take_ragged` reads, each row
    from its own chunk's memory-mapped offsets and bytes (``take`` would first concatenate the whole
    column, every prompt row's JSON, into a private copy, for every batch)."""
    import pyarrow as pa

    chunks, which, local = _chunks_of(dataset, indices, name)
    views: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    out: list[str | None] = []
    for k, row in zip(which.tolist(), local.tolist()):
        chunk = chunks[k]
        if k not in views:
            _, offsets, data = chunk.buffers()
            width = np.int64 if pa.types.is_large_string(chunk.type) else np.int32
            offsets = np.frombuffer(offsets, dtype=width)[chunk.offset : chunk.offset + len(chunk) + 1]
            views[k] = offsets, np.frombuffer(data, dtype=np.uint8) if data is not None else np.zeros(0, np.uint8)
        offsets, data = views[k]
        if chunk.null_count and not chunk[row].is_valid:
            out.append(None)
        else:
            out.append(data[offsets[row] : offsets[row + 1]].tobytes().decode())
    return out


def narrow_index(positions: np.ndarray) -> np.ndarray:
    """Row positions as int32 while they fit (4 bytes a row, not numpy's 8): every rank keeps one."""
    return positions.astype(np.int32) if not len(positions) or positions.max() < 2**31 else positions
