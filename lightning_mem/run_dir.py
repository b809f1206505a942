"""The run's own folder: where a run's local files (memory timeline, resolved config) belong.

Lightning's ``trainer.log_dir`` is the versioned run folder for CSV and TensorBoard loggers, but
for MLflow and W&B it is the logger's ``save_dir``, shared by every run (``./mlruns``, ``.``): files
written there by one run are overwritten by the next. :func:`run_dir` gives one folder per run
for every logger:

- a logger with a local ``log_dir`` (CSVLogger, TensorBoardLogger): that folder,
  e.g. ``<default_root_dir>/logs/version_3``;
- any other logger (MLflowLogger, WandbLogger, ...):
  ``<trainer.default_root_dir>/<logger.name>/<logger.version>``, e.g.
  ``runs/sft/tiny_cpu/<experiment id>/<run id>`` for MLflow and ``runs/sft/tiny_cpu/<project>/<run id>``
  for W&B: the same layout as the CSV logger's, named after the run the logger created;
- no logger: ``trainer.default_root_dir``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any


def _part(value: Any, default: str) -> str:
    # Names come from remote services (experiment ids, run names): keep them to one path segment.
    if value is None or value == "":
        return default
    if isinstance(value, int):
        return f"version_{value}"
    return re.sub(r"[^A-Za-z0-9_.\-]+", "_", str(value)).strip(".") or default


def local_run_dir(trainer: Any) -> Path:
    """:func:`run_dir` without the broadcast (rank 0's answer; other ranks may see none)."""
    loggers = getattr(trainer, "loggers", None) or []
    if not loggers:
        return Path(trainer.default_root_dir)
    logger = loggers[0]
    log_dir = getattr(logger, "log_dir", None)
    if log_dir:
        return Path(log_dir)
    return Path(trainer.default_root_dir) / _part(logger.name, "logs") / _part(logger.version, "run")


def run_dir(trainer: Any) -> Path:
    """The first logger's run folder (see the module docstring), the same on every rank.

    Collective: call it on every rank (rank 0 decides, then broadcasts).
    """
    path = str(local_run_dir(trainer)) if trainer.is_global_zero else None
    return Path(trainer.strategy.broadcast(path))
