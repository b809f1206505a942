"""Checkpoints and exports that a crash cannot tear, and resumes that say what they ignore.

* :class:`AtomicCheckpointIO` writes a single-file checkpoint beside its target and renames it
  into place, so ``last.ckpt`` is always either the previous checkpoint or the new one, never a
  truncated file (a full disk, a kill mid-write).
* :func:`staged_directory` does the same for a folder (an HF export): it is written under a
  temporary name beside the target and swapped in only when complete.
* The sharded (folder) checkpoint format: each save is a versioned folder
  (:func:`version_dir`) holding the shards, the rest of the checkpoint (:data:`CHECKPOINT_METADATA`)
  and, written last, a completion marker (:data:`COMPLETE_MARKER`); :func:`publish_version` marks it
  and points the checkpoint's symlink at it (:func:`switch_link`), and :func:`check_complete`
  refuses a folder whose save did not finish. ``FSDP2Strategy`` writes it; the export reads it.
* :class:`ResumeCheck` warns when a resumed run keeps optimizer settings (``lr``...) from the
  checkpoint that differ from the config.
* :func:`find_last_checkpoint` tells ``--ckpt_path last`` where it looked.
* :func:`keep_trainable` / :func:`check_trainable_kept`: a checkpoint holds only what trains (a
  LoRA or 4-bit base, a PPO reference or reward model is re-read from its source on resume).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import fsspec
import torch
from lightning.pytorch import Callback
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_warn


def _fsync_dir(path: Path) -> None:
    # Makes the rename itself durable; not every OS lets a directory be opened (Windows).
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` that writes ``<dir>/.<name>.tmp-<id>``, syncs it, then renames it to ``<name>``.

    The temporary file is in the target's own folder, so the rename never crosses filesystems and
    is atomic; if anything fails the target is untouched and the temporary file is removed.
    Remote paths (``s3://``...) go to Lightning's own writer.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"`{type(self).__name__}.save_checkpoint` takes no `storage_options`")
        if fsspec.utils.get_protocol(str(path)) != "file":  # remote storage: fsspec's own writes
            return super().save_checkpoint(checkpoint, path)
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        _fsync_dir(target.parent)


@contextlib.contextmanager
def staged_directory(target: str | Path) -> Iterator[Path]:
    """Yield a fresh folder beside ``target``; on success it replaces ``target``, on failure it is removed.

    ``target`` never holds a half-written result: until the block succeeds it keeps what it held
    before (or does not exist). An existing ``target`` is moved aside, the new folder renamed into
    place, and only then the old one deleted.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.partial-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    old = None
    if target.exists() or target.is_symlink():
        old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(target, old)
    os.replace(staging, target)
    _fsync_dir(target.parent)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


# -- versioned folders behind a symlink (sharded checkpoints) ---------------------------------------


#: Written last into a sharded checkpoint folder, holding its global step: a folder without it
#: (or with another step than its metadata) is the remains of an interrupted save.
COMPLETE_MARKER = "COMPLETE"
#: Beside the shards, the rest of the checkpoint (loops, callbacks, step): the file name Lightning's
#: ``ModelParallelStrategy.load_checkpoint`` reads (tests/test_checkpointing.py holds the two equal).
CHECKPOINT_METADATA = "meta.pt"



def version_dir(link: str | Path, step: int, token: str) -> Path:
    """The folder one save of the checkpoint ``link`` writes to: ``<link>.step<step>.<token>``."""
    link = Path(link)
    return link.parent / f"{link.name}.step{step}.{token}"


def checkpoint_versions(link: str | Path) -> list[Path]:
    """Every versioned folder of ``link`` present on disk (complete or not)."""
    link = Path(link)
    if not link.parent.is_dir():
        return []
    prefix = f"{link.name}.step"
    return sorted(p for p in link.parent.iterdir() if p.name.startswith(prefix) and p.is_dir())


def switch_link(link: str | Path, target: str | Path, *, keep: int = 2) -> Path | None:
    """Point ``link`` at ``target`` (a sibling folder) atomically; keep ``keep`` versions in all.

    The symlink is replaced with ``os.replace``, so ``link`` always names a complete checkpoint.
    A ``link`` that is still a plain folder (the old in-place layout) is moved aside to a version
    of its own. Returns the previous target (kept), or None.
    """
    link, target = Path(link), Path(target)
    previous: Path | None = None
    if link.is_symlink():
        previous = link.parent / os.readlink(link)
    elif link.is_dir():
        previous = link.parent / f"{link.name}.step-legacy.{uuid.uuid4().hex[:8]}"
        os.replace(link, previous)
    elif link.exists():
        link.unlink()
    tmp_link = link.parent / f".{link.name}.link-{uuid.uuid4().hex[:8]}"
    os.symlink(target.name, tmp_link)  # relative: the folder can move as a whole
    os.replace(tmp_link, link)
    _fsync_dir(link.parent)
    kept = {target.resolve()} | ({previous.resolve()} if previous is not None and keep > 1 else set())
    for version in checkpoint_versions(link):
        if version.resolve() not in kept:
            shutil.rmtree(version, ignore_errors=True)
    return previous


def remove_versioned(link: str | Path) -> None:
    """Remove the symlink ``link`` and every versioned folder behind it."""
    link = Path(link)
    for version in checkpoint_versions(link):
        shutil.rmtree(version, ignore_errors=True)
    if link.is_symlink() or link.is_file():
        link.unlink()
    elif link.is_dir():
        shutil.rmtree(link)


def publish_version(link: str | Path, folder: str | Path, step: int, *, keep: int = 2) -> Path | None:
    """Mark the versioned folder ``folder`` complete at ``step``, then point ``link`` at it.

    Call once (rank 0) after every rank's shards and the metadata are on disk: the marker is
    written last, so a folder that has it was written in full. Returns the previous version (kept).
    """
    folder = Path(folder)
    marker = folder / COMPLETE_MARKER
    marker.write_text(f"{step}\n")
    return switch_link(link, folder, keep=keep)


def check_complete(path: str | Path) -> None:
    """Raise unless the sharded checkpoint folder ``path`` was completely written (its marker is
    there and names the step its metadata has)."""
    path = Path(path)
    marker = path / COMPLETE_MARKER
    if not marker.is_file():
        raise RuntimeError(
            f"The sharded checkpoint {path} is incomplete (no {COMPLETE_MARKER} marker): its save was"
            " interrupted. Resume from the previous one (the other `*.ckpt.step*` folder beside it) instead."
        )
    marked = int(marker.read_text().strip() or -1)
    meta = torch.load(path / CHECKPOINT_METADATA, map_location="cpu", weights_only=False)
    if int(meta.get("global_step", -1)) != marked:
        raise RuntimeError(
            f"The sharded checkpoint {path} is torn: its shards were completed at step {marked} but its"
            f" metadata says step {meta.get('global_step')}. Resume from another checkpoint."
        )

# -- resuming -----------------------------------------------------------------------------------------


def find_last_checkpoint(dirpath: str | Path) -> Path | None:
    """The newest ``last*.ckpt`` (file, folder or link) in ``dirpath``, as ``--ckpt_path last`` finds it."""
    dirpath = Path(dirpath)
    if not dirpath.is_dir():
        return None
    found = [p for p in dirpath.glob("last*.ckpt") if p.exists()]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


#: Optimizer settings compared on resume; ``lr`` is compared through ``initial_lr`` when a
#: scheduler set one (the scheduled ``lr`` moves every step).
_COMPARED = ("lr", "weight_decay", "betas", "eps", "momentum")


class ResumeCheck(Callback):
    """Warn when a resumed run's optimizers keep settings from the checkpoint that the config changed.

    Lightning restores each optimizer's ``param_groups`` (and the scheduler's base rates) from the
    checkpoint, so a new ``lr`` in the config is silently ignored. This records the configured
    values before the restore and compares them after it.

    Args:
        keys: the config key of each optimizer, in ``configure_optimizers`` order (e.g.
            ``["model.optimizer", "model.critic_optimizer"]``); others are named by index.
    """

    def __init__(self, keys: Sequence[str] = ()) -> None:
        self.keys = list(keys)
        self._configured: list[list[dict[str, Any]]] | None = None

    @staticmethod
    def _settings(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
        groups = []
        for group in optimizer.param_groups:
            values = {k: group[k] for k in _COMPARED if k in group}
            if "initial_lr" in group:
                values["lr"] = group["initial_lr"]
            groups.append({k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})
        return groups

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        # Optimizers exist and hold the config's values; the checkpoint is restored after this.
        if trainer.ckpt_path:
            self._configured = [self._settings(o) for o in trainer.optimizers]

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self._configured is None:
            return
        for index, (optimizer, configured) in enumerate(zip(trainer.optimizers, self._configured)):
            restored = self._settings(optimizer)
            changed = sorted({k for c, r in zip(configured, restored) for k in c if k in r and c[k] != r[k]})
            key = self.keys[index] if index < len(self.keys) else f"optimizer {index}"
            for name in changed:
                before = next(r[name] for c, r in zip(configured, restored) if name in c and c[name] != r.get(name))
                now = next(c[name] for c, r in zip(configured, restored) if name in c and c[name] != r.get(name))
                rank_zero_warn(
                    f"`{key}.init_args.{name}` is {now} in the config but the resumed checkpoint"
                    f" ({trainer.ckpt_path}) has {before}; the checkpoint's value is kept. To train with the new"
                    " value, start a new run from the exported model instead of resuming."
                )
        self._configured = None


# -- checkpoint only what trains -----------------------------------------------------------------


def trainable_names(module: torch.nn.Module) -> set[str]:
    """The names of ``module``'s parameters that train (``requires_grad``): what a checkpoint keeps
    and what a ``trainable_only`` export gathers."""
    return {name for name, param in module.named_parameters() if param.requires_grad}


def keep_trainable(module: torch.nn.Module, checkpoint: dict[str, Any]) -> None:
    """For ``on_save_checkpoint``: cut ``checkpoint["state_dict"]`` to ``module``'s trainable parameters.

    Frozen weights (a LoRA or 4-bit base, a PPO reference or reward model) never change: they are
    re-read from their source on resume, and saving them would make every checkpoint as large as
    the models (tens of GB at 70B) for nothing. The module must load non-strictly
    (``strict_loading = False``). A strategy that keeps the weights out of the checkpoint dict
    (DeepSpeed saves them itself) leaves no ``state_dict`` here, and nothing is done.
    """
    if "state_dict" in checkpoint:
        keep = trainable_names(module)
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in keep}


def check_trainable_kept(module: torch.nn.Module, checkpoint: dict[str, Any]) -> None:
    """For ``on_load_checkpoint``: loading is non-strict for the frozen weights' sake, so check that
    every trainable parameter is still there (a checkpoint of another config is an error, not a
    silently fresh adapter)."""
    if "state_dict" not in checkpoint:
        return
    missing = sorted(trainable_names(module) - set(checkpoint["state_dict"]))
    if missing:
        raise KeyError(f"the checkpoint lacks {len(missing)} trainable tensors, e.g. {missing[:3]}")


def saved_module_keys(path: str | Path) -> set[str]:
    """The module tensors a sharded (torch distributed) checkpoint folder holds, under the module's
    own names (the folder stores them as ``state_dict.<name>``)."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return {k.removeprefix("state_dict.") for k in metadata if k.startswith("state_dict.")}


def load_sharded_checkpoint(
    module: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer], path: str | Path, *, strict: bool
) -> None:
    """Load a sharded checkpoint folder's module tensors and optimizer states into ``module`` (and
    its ``optimizers``, saved as ``optimizer_<i>``) in place, on every rank.

    Lightning's loader asks the folder for every tensor the module has, so a checkpoint that holds
    only what trains (:func:`keep_trainable`) could not be resumed. Here a non-strict module gets
    the tensors the folder has and keeps the rest as loaded (the frozen weights, re-read from
    their source); a strict one is told which tensors are missing.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    saved = saved_module_keys(path)
    own = get_model_state_dict(module)
    missing = sorted(set(own) - saved)
    if missing and strict:
        raise KeyError(f"the checkpoint {path} lacks {len(missing)} of the model's tensors (e.g. {missing[:3]})")
    state = {k: v for k, v in own.items() if k in saved}
    dcp.load({"state_dict": state}, checkpoint_id=str(path))
    module.load_state_dict(state, strict=False)
    for i, optimizer in enumerate(optimizers):
        key = f"optimizer_{i}"
        optimizer_state = {key: get_optimizer_state_dict(module, optimizer)}
        dcp.load(optimizer_state, checkpoint_id=str(path))
        set_optimizer_state_dict(module, optimizer, optim_state_dict=optimizer_state[key],
                                 options=StateDictOptions(cpu_offload=True))
