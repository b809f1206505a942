"""Precomputed reference log-probs on disk, keyed by what they were computed from.

DPO's ``precompute`` runs the reference once over the data before training; the result is tiny
(two float32 sums a pair: 8 MB for a million pairs) and worth keeping: the next run with the same
reference and data, and every rank, reads it instead of loading a reference at all. Reusing values
computed from *other* inputs would train against the wrong reference without any sign (TRL #1962,
#6443), so each file carries its key, and a key that does not match is refused in one line that
names the file and what differs.

The key (:func:`cache_key`):

- ``reference``: the weights (:func:`weights_identity`), identified without reading tens of GB:
  each weight file's name and size, and a sha256 of its safetensors header plus 4 KiB at the
  start, middle and end of every tensor in it. The header alone would not do: two checkpoints of
  one architecture (a model before and after fine-tuning) have the same header and sizes; a tensor
  that trained differs nearly everywhere, so its samples tell them apart. A hub id that is not on disk is identified by
  its id (and the cached snapshot's commit when there is one). A config-only folder never reaches
  here: its seeded random weights are saved to disk first (:func:`lightning_mem.lora.saved_base`);
- ``data``: the tokenized pairs (the data module's ``data_identity``);
- ``precision`` and ``dtype``: ``trainer.precision`` and the model's dtype setting;
- ``attention``: the attention implementation;
- ``code``: a hash of the code that computes the values (the logits path and the scoring function).

Layout: ``<folder>/<split>.safetensors``, one float32 tensor ``logps`` of shape ``[pairs, 2]``
(chosen, rejected) and the key as JSON in the file's metadata; written to a temporary name and
renamed, so a reader never sees half a file.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import struct
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_mem.settings import SettingError

FORMAT = 1
_BLOCK = 64 * 1024
_PIECE = 4 * 1024
_SAMPLES = 16
_WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "*.pt", "*.safetensors.index.json")


def _sampled_digest(path: Path) -> str:
    """sha256 of a few KiB of every tensor of a safetensors file (its start, middle and end) and of
    the header that lists them; other formats: :data:`_SAMPLES` blocks spread through the file.

    Every tensor is sampled, not the file: fine-tuning changes nearly every value of each tensor it
    trains, but it may train only some tensors (the last block, a norm), which blocks spread over
    the file could all miss. About 12 KiB a tensor: a few MB for a 70B checkpoint."""
    size = path.stat().st_size
    digest = hashlib.sha256()
    with path.open("rb") as f:
        if path.suffix == ".safetensors" and size >= 8:
            (length,) = struct.unpack("<Q", f.read(8))
            header = f.read(min(length, size - 8))
            digest.update(header)
            spans = sorted(tuple(entry["data_offsets"]) for name, entry in json.loads(header).items()
                           if name != "__metadata__")
            for start, end in spans:
                for at in sorted({start, max(start, (start + end) // 2 - _PIECE // 2), max(start, end - _PIECE)}):
                    f.seek(8 + length + at)
                    digest.update(f.read(min(_PIECE, end - at)))
            return digest.hexdigest()
        last = max(size - _BLOCK, 0)
        for i in range(_SAMPLES):
            f.seek(last * i // (_SAMPLES - 1))
            digest.update(f.read(_BLOCK))
    return digest.hexdigest()


def _folder_identity(folder: Path) -> dict[str, Any]:
    files = sorted({p for pattern in _WEIGHT_PATTERNS for p in folder.glob(pattern)})
    config = folder / "config.json"
    return {
        "config": hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else None,
        # resolve(): a hub snapshot's files are links to its blobs.
        "files": [[p.name, p.resolve().stat().st_size, _sampled_digest(p.resolve())] for p in files],
    }


def _hub_snapshot(repo_id: str) -> Path | None:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - a dependency of transformers
        return None
    found = try_to_load_from_cache(repo_id, "config.json")
    return Path(found).parent if isinstance(found, str) else None


def weights_identity(name_or_path: str) -> dict[str, Any]:
    """What identifies a model's weights cheaply (see the module docstring): a folder's weight files
    by name, size and sampled digest; a hub id by its cached snapshot's files and commit, or by the
    id alone when nothing is cached."""
    folder = Path(name_or_path).expanduser()
    if folder.is_dir():
        return _folder_identity(folder)
    snapshot = _hub_snapshot(name_or_path)
    if snapshot is None:
        return {"hub": name_or_path}
    return {"hub": name_or_path, "commit": snapshot.name, **_folder_identity(snapshot)}


def code_version(*parts: Any) -> str:
    """A hash of the code that computes the values: a module's whole file, a function's own
    source. Any change to it makes a new key rather than trusting numbers the old code wrote."""
    digest = hashlib.sha256(f"reference-logps-{FORMAT}".encode())
    for part in parts:
        if inspect.ismodule(part):
            digest.update(Path(inspect.getsourcefile(part)).read_bytes())
        else:
            digest.update(inspect.getsource(part).encode())
    return digest.hexdigest()[:16]


def cache_key(*, reference: dict[str, Any], data: str, precision: str, dtype: str | None, attention: str | None,
              code: str) -> dict[str, Any]:
    """The key a table is stored under (every field must match for it to be used)."""
    return {"format": FORMAT, "reference": reference, "data": data, "precision": str(precision),
            "dtype": None if dtype is None else str(dtype), "attention": attention, "code": code}


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return text if len(text) <= 24 else hashlib.sha256(text.encode()).hexdigest()[:12]


def differences(stored: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    """``["data ('a1' there, 'b2' here)", ...]``: the key's fields that differ, values shortened
    (a long one to a hash of it)."""
    fields = sorted(set(stored) | set(wanted))
    return [f"{k} ({_short(stored.get(k))!r} there, {_short(wanted.get(k))!r} here)"
            for k in fields if stored.get(k) != wanted.get(k)]


class ReferenceLogpCache:
    """The folder that keeps a run's precomputed reference log-probs, a file per split.

    :meth:`lookup` says whether a split's file can be used (True), is missing (False), or holds
    values of other inputs (a :class:`~lightning_mem.settings.SettingError` naming ``cache_dir``,
    which a recipe names from its YAML with ``settings_at``).
    """

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)

    def path(self, split: str) -> Path:
        return self.folder / f"{split}.safetensors"

    def stored_key(self, split: str) -> dict[str, Any] | None:
        path = self.path(split)
        if not path.is_file():
            return None
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                return json.loads((f.metadata() or {}).get("key", "null"))
        except Exception as err:  # a file this code did not write, or a torn copy
            raise SettingError("cache_dir", f": {path} is not a reference log-prob file ({err}); delete it") from None

    def lookup(self, split: str, key: dict[str, Any]) -> bool:
        stored = self.stored_key(split)
        if stored is None:
            return False
        key = json.loads(json.dumps(key, sort_keys=True))  # as stored: tuples become lists
        if stored != key:
            raise SettingError(
                "cache_dir",
                f"`cache_dir`: {self.path(split)} holds reference log-probs of other inputs ({'; '.join(differences(stored, key))});"
                " delete it, or set `cache_dir` to another folder",
            )
        return True

    def load(self, split: str, key: dict[str, Any], device: torch.device | str = "cpu") -> Tensor:
        if not self.lookup(split, key):
            raise FileNotFoundError(f"{self.path(split)}: no reference log-probs")
        from safetensors.torch import load_file

        return load_file(str(self.path(split)), device=str(device))["logps"]

    def save(self, split: str, key: dict[str, Any], table: Tensor) -> Path:
        from safetensors.torch import save_file

        path = self.path(split)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        save_file({"logps": table.detach().float().cpu().contiguous()}, str(tmp), metadata={"key": json.dumps(key, sort_keys=True)})
        os.replace(tmp, path)
        return path
