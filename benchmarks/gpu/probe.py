"""The callback a GPU tier run adds to a recipe (``--trainer.callbacks``): each training batch's
wall time and tokens, and the MemoryMonitor's per-step and per-phase samples, kept for the runner.

A recipe's own ``main`` builds the Trainer, so the runner cannot hand it an object; the probe
registers itself in :data:`TierProbe.instances` when Lightning sets it up, and the runner (same
process) reads it after ``fit`` returns or raises (an out-of-memory error is a result too).
"""

from __future__ import annotations

import time
from typing import Any, ClassVar

import torch
from lightning.pytorch import Callback

from lightning_mem.callbacks import MemoryMonitor


def batch_tokens(batch: Any) -> int:
    """The tokens a training batch feeds the model: its attention mask's ones (padding left out),
    else every position of ``input_ids``; 0 for a batch with neither."""
    if isinstance(batch, dict):
        mask = batch.get("attention_mask")
        if isinstance(mask, torch.Tensor):
            return int(mask.sum())
        ids = batch.get("input_ids")
        if isinstance(ids, torch.Tensor):
            return ids.numel()
    return 0


class TierProbe(Callback):
    """Record each training batch: seconds (device work included: CUDA is synchronized at both
    ends) and tokens. For a PPO step the tokens are the responses it generated (from the recipe's
    logged ``gen_tokens_per_s`` and ``time_rollout_s``), not the prompts it was given."""

    #: Every probe Lightning set up in this process, the latest last.
    instances: ClassVar[list["TierProbe"]] = []

    def __init__(self) -> None:
        self.batches: list[dict[str, Any]] = []
        self.monitor: MemoryMonitor | None = None
        self._start = 0.0
        self._tokens = 0

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.monitor = next((c for c in trainer.callbacks if isinstance(c, MemoryMonitor)), None)
        TierProbe.instances.append(self)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._sync(trainer)
        self._tokens = batch_tokens(batch)
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._sync(trainer)
        seconds = time.perf_counter() - self._start
        metrics = trainer.callback_metrics
        record = {"seconds": seconds, "tokens": self._tokens, "tokens_kind": "input"}
        if "gen_tokens_per_s" in metrics and "time_rollout_s" in metrics:
            # A PPO step logs its rollout's speed and time; their product is the tokens it generated.
            rollout_rate = float(metrics["gen_tokens_per_s"])
            record.update(tokens=int(round(rollout_rate * float(metrics["time_rollout_s"]))), tokens_kind="generated",
                          rollout_tokens_per_s=rollout_rate)
            # Each phase's seconds (rollout, score, train and the engine's transitions), as logged.
            record["phase_s"] = {key[len("time_"):-len("_s")]: float(value) for key, value in metrics.items()
                                 if key.startswith("time_") and key.endswith("_s")}
        self.batches.append(record)

    @staticmethod
    def _sync(trainer: Any) -> None:
        device = trainer.strategy.root_device
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    @property
    def memory_rows(self) -> list[dict[str, Any]]:
        """The MemoryMonitor's samples (step ends and phase ends), or none without a monitor."""
        return list(self.monitor.rows) if self.monitor is not None else []
