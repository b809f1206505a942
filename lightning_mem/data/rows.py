"""Where training rows come from: JSONL, JSON or Parquet files, folders written by ``datasets``'
``save_to_disk``, and Hugging Face hub datasets (``datasets.load_dataset``), with a column mapping
(``columns: {prompt: question}``) for other datasets' field names.

Every row read keeps its origin in ``_where`` (file and line), so that later checks can name it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_mem.settings import SettingError, SettingPathError

log = logging.getLogger(__name__)

_FORMATS = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet"}


class DataFormatError(ValueError):
    """A data file or row that cannot be used; the message names the file and line."""


class DataSettingError(SettingError, DataFormatError):
    """Data that do not fit a setting (the split it names, a column it maps): a
    :class:`DataFormatError` that names the setting, relative to the datamodule's arguments."""


# ---------------------------------------------------------------------------------------------
# Reading rows
# ---------------------------------------------------------------------------------------------


def is_saved_dataset(path: Path) -> bool:
    """A folder written by ``datasets``' ``save_to_disk`` (a Dataset or a DatasetDict)."""
    return (path / "dataset_dict.json").is_file() or ((path / "state.json").is_file() and (path / "dataset_info.json").is_file())


def check_data_file(path: str | Path, *, key: str) -> Path:
    """Fail early, naming ``key``, when a data file is missing or of an unknown format.

    A folder is accepted when ``datasets`` wrote it with ``save_to_disk``.
    """
    p = Path(path).expanduser()
    if p.is_dir():
        if is_saved_dataset(p):
            return p
        raise DataSettingError(
            key,
            f": {str(path)!r} is a directory, not a data file; a folder must be a `datasets` save_to_disk"
            " folder (with dataset_info.json and state.json, or dataset_dict.json)",
        )
    if not p.is_file():
        raise SettingPathError(key, f": data file {str(path)!r} does not exist")
    if p.suffix not in _FORMATS:
        raise DataSettingError(key, f": {str(path)!r} has an unknown format; use one of {sorted(_FORMATS)}")
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


def row_record(row: Any, where: str) -> dict[str, Any]:
    """``row`` (a parsed JSON object) cleaned, with ``_where`` naming its file and line for errors."""
    if not isinstance(row, dict):
        raise DataFormatError(f"{where}: expected a JSON object, got {type(row).__name__}")
    return {**_clean(row), "_where": where}


def decode_utf8(data: bytes, p: Path, line_offset: int = 0) -> str:
    """``data`` (bytes of ``p`` from line ``line_offset + 1``) as text; not UTF-8: an error naming the line."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = line_offset + data[: err.start].count(b"\n") + 1
        raise DataFormatError(f"{p}:{line}: not valid UTF-8 (byte {data[err.start]:#04x}); save the file as UTF-8") from None


def _read_jsonl(p: Path) -> list[dict[str, Any]]:
    rows = []
    with p.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            line = decode_utf8(raw, p, lineno - 1)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataFormatError(f"{p}:{lineno}: not valid JSON ({err.msg})") from None
            rows.append(row_record(row, f"{p}:{lineno}"))
    return rows


def _read_json(p: Path) -> list[dict[str, Any]]:
    # Read here rather than through Arrow: rows of different shapes (messages and prompt/completion,
    # string and conversational prompts) would otherwise be forced into one schema.
    text = decode_utf8(p.read_bytes(), p)
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
    return [row_record(row, f"{p}:row {i}") for i, row in enumerate(data)]


def _read_parquet(p: Path) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(p)
    except Exception as err:  # pyarrow's messages do not name the file
        raise DataFormatError(f"{p}: not a readable Parquet file ({err})") from None
    return [row_record(row, f"{p}:row {i}") for i, row in enumerate(table.to_pylist())]


def _read_saved(p: Path, split: str | None, split_key: str) -> list[dict[str, Any]]:
    import datasets

    try:
        data = datasets.load_from_disk(str(p))
    except Exception as err:
        raise DataFormatError(f"{p}: not a readable `datasets` save_to_disk folder ({err})") from None
    if isinstance(data, datasets.DatasetDict):
        if split not in data:
            raise DataSettingError(split_key, f": {p} holds the splits {sorted(data)}, not {split!r}")
        data, where = data[split], f"{p}[{split}]"
    else:
        where = str(p)
    return [row_record(row, f"{where}:row {i}") for i, row in enumerate(data)]


def read_rows(path: str | Path, *, split: str | None = "train", split_key: str = "split") -> list[dict[str, Any]]:
    """Rows of a JSONL, JSON or Parquet file, or of a ``save_to_disk`` folder (``split`` of a
    DatasetDict; a split it lacks is an error naming ``split_key``). Each row gets ``_where`` (file
    and line or row number) for error messages."""
    p = Path(path)
    if p.is_dir():
        return _read_saved(p, split, split_key)
    if p.suffix == ".jsonl":
        return _read_jsonl(p)
    if p.suffix == ".json":
        return _read_json(p)
    return _read_parquet(p)


def load_hub(dataset: str, *, subset: str | None, split: str, key: str = "dataset") -> Any:
    """``datasets.load_dataset(dataset, name=subset, split=split)``, a failure naming ``key``.

    Downloads go to the ``datasets`` cache (``HF_DATASETS_CACHE``); offline, the cache is used.
    """
    import datasets

    try:
        return datasets.load_dataset(dataset, name=subset, split=split)
    except Exception as err:
        raise DataSettingError(key, f": could not load {dataset!r} (subset={subset!r}, split={split!r}): {err}") from None


def read_hub_rows(dataset: str, *, subset: str | None, split: str, key: str = "dataset", data: Any = None) -> list[dict[str, Any]]:
    """Rows of a Hugging Face hub dataset (``data``, when :func:`load_hub` already loaded it)."""
    if data is None:
        data = load_hub(dataset, subset=subset, split=split, key=key)
    where = f"{dataset}" + (f"/{subset}" if subset else "") + f"[{split}]"
    return [row_record(row, f"{where}:row {i}") for i, row in enumerate(data)]


def rename_columns(rows: list[dict[str, Any]], columns: dict[str, str] | None, *, key: str = "columns") -> list[dict[str, Any]]:
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
                raise DataSettingError(f"{key}.{ours}", f": {row.get('_where', 'row')} has no field {theirs!r}; it has {keys}")
            row[ours] = row.pop(theirs)
        out.append(row)
    return out


def check_columns(columns: Any, *, key: str = "columns") -> dict[str, str] | None:
    if columns is None:
        return None
    if not isinstance(columns, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in columns.items()):
        raise SettingError(
            key, f" must map field names this module reads to the dataset's names, e.g. {{prompt: question}}; got {columns!r}"
        )
    return dict(columns)




@dataclass
class DataSource:
    """A datamodule's rows: local files or ``save_to_disk`` folders, or a Hugging Face hub dataset.

    Built by :func:`data_source`, which checks the settings (naming them) without reading data.
    """

    train_file: Path | None = None
    val_file: Path | None = None
    dataset: str | None = None
    subset: str | None = None
    train_split: str = "train"
    val_split: str | None = None
    columns: dict[str, str] | None = None
    #: Hub datasets loaded so far, by split: the tokenized cache's key and the rows come from one load.
    _hub: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def hub_split(self, split: str) -> Any:
        """The hub dataset's ``split`` (loaded once; ``datasets`` keeps the download)."""
        if split not in self._hub:
            self._hub[split] = load_hub(self.dataset, subset=self.subset, split=split)
        return self._hub[split]

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
                rows = read_rows(self.train_file, split=self.train_split, split_key="train_split")
            else:
                rows = read_hub_rows(self.dataset, subset=self.subset, split=self.train_split, data=self.hub_split(self.train_split))
        elif self.val_file is not None:
            rows = read_rows(self.val_file, split=self.val_split, split_key="val_split")
        elif self.train_file is not None:
            rows = read_rows(self.train_file, split=self.val_split, split_key="val_split")
        else:
            rows = read_hub_rows(self.dataset, subset=self.subset, split=self.val_split, data=self.hub_split(self.val_split))
        return rename_columns(rows, self.columns)


    def first_row(self, which: str = "train") -> dict[str, Any]:
        """The first ``"train"`` or ``"val"`` row, with ``columns`` applied; a JSONL file is read up to
        its first row only."""
        path = self.train_file if which == "train" else self.val_file
        if path is not None and path.is_file() and path.suffix == ".jsonl":
            with path.open("rb") as f:
                for lineno, raw in enumerate(f, start=1):
                    line = decode_utf8(raw, path, lineno - 1)
                    if line.strip():
                        try:
                            row = json.loads(line)
                        except json.JSONDecodeError as err:
                            raise DataFormatError(f"{path}:{lineno}: not valid JSON ({err.msg})") from None
                        return rename_columns([row_record(row, f"{path}:{lineno}")], self.columns)[0]
            raise DataFormatError(f"{path}: no rows")
        rows = self.rows(which)
        if not rows:
            raise DataFormatError(f"{self.describe(which)}: no rows")
        return rows[0]


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
    """Check a datamodule's data settings, naming the argument at fault (a
    :class:`~lightning_mem.settings.SettingError`); reads nothing but folder metadata."""
    if (train_file is None) == (dataset is None):
        raise SettingError(
            "train_file",
            "set exactly one of `train_file` (a JSONL/JSON/Parquet file or a save_to_disk folder) and"
            f" `dataset` (a Hugging Face hub id); got train_file={train_file!r}, dataset={dataset!r}",
            siblings=("dataset",),
        )
    if subset is not None and dataset is None:
        raise SettingError("subset", " names a configuration of a hub dataset: set `dataset` too", siblings=("dataset",))
    if dataset is not None and not (isinstance(dataset, str) and dataset.strip()):
        raise SettingError("dataset", f" must be a hub id such as 'trl-lib/Capybara', got {dataset!r}")
    train_path = check_data_file(train_file, key="train_file") if train_file is not None else None
    val_path = check_data_file(val_file, key="val_file") if val_file else None
    if val_split is not None and val_path is None and train_path is not None and not _has_splits(train_path):
        raise SettingError(
            "val_split",
            " picks a split of `dataset` or of a save_to_disk DatasetDict folder;"
            f" `train_file` {str(train_path)!r} has no splits: set `val_file` instead",
            siblings=("dataset", "train_file", "val_file"),
        )
    if val_path is not None and _has_splits(val_path) and val_split is None:
        raise SettingError(
            "val_split", f": `val_file` {str(val_path)!r} is a DatasetDict folder; name its split", siblings=("val_file",)
        )
    return DataSource(train_path, val_path, dataset, subset, train_split, val_split, check_columns(columns))


def warn_once(message: str) -> None:
    """A warning on global rank 0 only (each rank reads the same data and would repeat it)."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    if getattr(rank_zero_only, "rank", 0) == 0:
        log.warning(message)
