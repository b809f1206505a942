"""Memory per step and per named phase; a CSV and PNG timeline; a snapshot and a hint on OOM."""

from __future__ import annotations

import contextlib
import csv
import logging
import re
import time
from collections import deque
from pathlib import Path
from typing import Any, Iterator, Optional, Protocol, runtime_checkable

import lightning.pytorch as pl
import psutil
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import WarningCache
from typing_extensions import override

from lightning_mem.run_dir import run_dir
from lightning_mem.settings import SettingError, callback_args

log = logging.getLogger(__name__)
_warning_cache = WarningCache()

_GIB = 1024**3
#: Samples kept in memory (``MemoryMonitor.rows``); all of them go to the CSV as they are taken.
_KEPT_ROWS = 256
_METRICS = (
    "device_allocated_bytes",
    "device_reserved_bytes",
    "device_peak_allocated_bytes",
    "device_peak_reserved_bytes",
    "device_used_bytes",
    "host_rss_bytes",
    "pinned_host_bytes",
)


class MemoryMonitor(Callback):
    """Record memory per training step and per phase, log it, and explain out-of-memory errors.

    Per step (at the end of each training batch) and per phase (at the end of each
    ``with monitor.phase(name)`` block, see :func:`memory_phase`), it samples:

    - ``device_allocated_bytes``, ``device_reserved_bytes``: CUDA caching allocator, now;
    - ``device_peak_allocated_bytes``: the peak allocated within that step or phase;
    - ``device_peak_reserved_bytes``: the peak the caching allocator held within it (what a
      ``torch.cuda.set_per_process_memory_fraction`` cap, or the card, runs out of);
    - ``device_used_bytes``: the whole device as NVML sees it (all processes), if available;
    - ``host_rss_bytes``: this process's resident host memory (the only one on CPU);
    - ``pinned_host_bytes``: pinned host memory held by torch's caching host allocator.

    Step samples are logged as ``memory/<metric>``, phase samples as ``memory/<phase>/<metric>``,
    through the trainer's loggers at ``trainer.global_step``. Every sample is appended to
    ``memory.csv`` as it is taken (a long run's monitor holds only the last few in memory, so it
    does not itself make host memory grow), and at the end of fit ``memory.png`` (a timeline from
    zero, with each phase's spans shaded and
    named, device memory above host memory where there is a device) are written to the logger's run
    folder (:func:`lightning_mem.run_dir.run_dir`: ``<save_dir>/<name>/version_N`` for CSV and
    TensorBoard, ``<default_root_dir>/<name>/<run id>`` for MLflow and W&B; ``memory_rank<r>.*`` on
    each rank when there are several).

    On a CUDA out-of-memory error (``torch.OutOfMemoryError``), it writes a snapshot of the
    allocator (``memory_snapshot.pickle``; drag it onto https://pytorch.org/memory_viz) and logs
    one line that says where it happened and which knob to turn. Lightning then re-raises the
    error. Stack traces in the snapshot need ``record_history=True`` (it costs some speed).

    Args:
        every_n_steps: log step samples every n training batches (all go to the CSV).
        record_history: record allocation stack traces for the OOM snapshot (CUDA only).
        history_max_entries: how many allocation events the history keeps.
        plot: write ``memory.png`` at the end of fit.

    Example (YAML)::

        trainer:
          callbacks:
            - class_path: lightning_mem.callbacks.MemoryMonitor
              init_args: {record_history: true}
    """

    def __init__(
        self,
        every_n_steps: int = 1,
        record_history: bool = False,
        history_max_entries: int = 100_000,
        plot: bool = True,
    ) -> None:
        if every_n_steps < 1:
            raise SettingError("every_n_steps", f" must be >= 1, got {every_n_steps}", prefix=f"{callback_args(self)}.")
        self.every_n_steps = every_n_steps
        self.record_history = record_history
        self.history_max_entries = history_max_entries
        self.plot = plot
        self.rows: deque[dict[str, Any]] = deque(maxlen=_KEPT_ROWS)  # the latest samples
        self._csv_columns: Optional[list[str]] = None
        self._trainer: Optional[pl.Trainer] = None
        self._device = torch.device("cpu")
        self._out_dir: Optional[Path] = None
        self._suffix = ""
        self._t0 = time.perf_counter()
        # Open step/phase scopes: [name, start time, running peak allocated, running peak reserved].
        self._scopes: list[list[Any]] = []
        self._nvml_ok = True
        self._history_on = False
        self._stage = "forward"  # forward | backward | optimizer step: for the OOM hint
        self._step_hooks: list[Any] = []
        self._failed_phase: Optional[str] = None  # innermost phase an exception left

    # -- phase API -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Measure the enclosed block as phase ``name`` (e.g. "rollout", "train"); may nest."""
        if not re.fullmatch(r"[A-Za-z0-9_.\-]+", name):
            raise ValueError(f"MemoryMonitor.phase: name {name!r} must be letters, digits, '_', '-', '.'")
        self._open_scope(name)
        try:
            yield
        except BaseException:
            # The block is closed by the time Lightning calls on_exception: remember where.
            self._failed_phase = self._failed_phase or name
            raise
        finally:
            self._close_scope(name, event="phase")

    # -- Lightning hooks -------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._trainer = trainer
        self._device = trainer.strategy.root_device
        if self.record_history:
            if torch.cuda.is_available():
                torch.cuda.memory._record_memory_history(max_entries=self.history_max_entries)
                self._history_on = True
            else:
                _warning_cache.warn("MemoryMonitor: record_history=True does nothing without CUDA.")

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Resolved here, on every rank: run_dir broadcasts, which an OOM handler must not.
        self._out_dir = run_dir(trainer)
        self._suffix = f"_rank{trainer.global_rank}" if trainer.world_size > 1 else ""
        self._t0 = time.perf_counter()
        self.rows.clear()
        self._csv_columns = None  # the first sample starts a new file
        for optimizer in trainer.optimizers:
            self._step_hooks.append(optimizer.register_step_post_hook(self._after_optimizer_step))

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self._stage = "forward"
        self._failed_phase = None
        # A batch that ended without on_train_batch_end (an epoch cut short) leaves its scope open.
        self._scopes = [s for s in self._scopes if s[0] != "step"]
        self._open_scope("step")

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self._stage = "backward"

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stage = "forward"

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._stage = "optimizer step"

    def _after_optimizer_step(self, *_: Any) -> None:
        self._stage = "forward"

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if any(s[0] == "step" for s in self._scopes):
            self._close_scope("step", event="step", log=(batch_idx + 1) % self.every_n_steps == 0)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.write()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for handle in self._step_hooks:
            handle.remove()
        self._step_hooks.clear()
        if self._history_on:
            torch.cuda.memory._record_memory_history(enabled=None)
            self._history_on = False

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, torch.OutOfMemoryError):
            return
        snapshot = self._dump_snapshot()
        log.error(self.oom_hint(trainer, snapshot))
        with contextlib.suppress(Exception):  # the timeline so far helps, but must not mask the OOM
            self.write()

    # -- sampling --------------------------------------------------------------------------------
    def _open_scope(self, name: str) -> None:
        self._fold_peak()
        self._scopes.append([name, time.perf_counter() - self._t0, 0, 0])
        self._reset_peak()

    def _close_scope(self, name: str, event: str, log: bool = True) -> None:
        self._fold_peak()
        index = max(i for i, s in enumerate(self._scopes) if s[0] == name)
        _, start, peak, peak_reserved = self._scopes.pop(index)
        sample = self.sample(peak, peak_reserved)
        row = {"time_s": round(time.perf_counter() - self._t0, 6), "start_s": round(start, 6), "event": event,
               "phase": name, "step": self._trainer.global_step if self._trainer else 0, **sample}
        self.rows.append(row)
        self._append_csv(row)
        if log:
            prefix = "memory/" if event == "step" else f"memory/{name}/"
            self._log({prefix + k: float(v) for k, v in sample.items()})

    def _fold_peak(self) -> None:
        # CUDA keeps one resettable peak; nested scopes each keep their own running maximum.
        if self._device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self._device)
            peak_reserved = torch.cuda.max_memory_reserved(self._device)
            for scope in self._scopes:
                scope[2] = max(scope[2], peak)
                scope[3] = max(scope[3], peak_reserved)

    def _reset_peak(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self._device)

    def sample(self, peak_allocated: int = 0, peak_reserved: int = 0) -> dict[str, int]:
        """Memory now: the metrics that exist on this device (host RSS always)."""
        out: dict[str, int] = {}
        if self._device.type == "cuda":
            out["device_allocated_bytes"] = torch.cuda.memory_allocated(self._device)
            out["device_reserved_bytes"] = torch.cuda.memory_reserved(self._device)
            out["device_peak_allocated_bytes"] = max(peak_allocated, torch.cuda.max_memory_allocated(self._device))
            out["device_peak_reserved_bytes"] = max(peak_reserved, torch.cuda.max_memory_reserved(self._device))
            if self._nvml_ok:
                try:
                    out["device_used_bytes"] = torch.cuda.device_memory_used(self._device)
                except Exception as err:  # no pynvml / amdsmi, or no driver access
                    self._nvml_ok = False
                    _warning_cache.warn(f"MemoryMonitor: device memory from NVML is not available ({err}).")
            out["pinned_host_bytes"] = int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))
        out["host_rss_bytes"] = psutil.Process().memory_info().rss
        return out

    def _log(self, metrics: dict[str, float]) -> None:
        if self._trainer is None:
            return
        for logger in self._trainer.loggers:
            logger.log_metrics(metrics, step=self._trainer.global_step)

    # -- outputs ---------------------------------------------------------------------------------
    @property
    def csv_path(self) -> Optional[Path]:
        return None if self._out_dir is None else self._out_dir / f"memory{self._suffix}.csv"

    @property
    def png_path(self) -> Optional[Path]:
        return None if self._out_dir is None else self._out_dir / f"memory{self._suffix}.png"

    def _append_csv(self, row: dict[str, Any]) -> None:
        # Written as taken: a run of 100k steps keeps none of its samples in memory, and a run
        # that dies keeps its timeline up to the last sample.
        if self._out_dir is None:
            return
        if self._csv_columns is None:
            self._out_dir.mkdir(parents=True, exist_ok=True)
            self._csv_columns = ["time_s", "start_s", "event", "phase", "step", *[m for m in _METRICS if m in row]]
            with open(self.csv_path, "w", newline="") as f:
                csv.DictWriter(f, fieldnames=self._csv_columns).writeheader()
        with open(self.csv_path, "a", newline="") as f:
            csv.DictWriter(f, fieldnames=self._csv_columns, restval="", extrasaction="ignore").writerow(row)

    def read_csv(self) -> list[dict[str, Any]]:
        """Every sample of this fit, from ``memory.csv`` (numbers as numbers, absent metrics left out)."""
        if self._out_dir is None or self._csv_columns is None or not self.csv_path.is_file():
            return []
        with open(self.csv_path, newline="") as f:
            return [_parse_row(r) for r in csv.DictReader(f)]

    def write(self) -> None:
        """Write ``memory.png`` (with ``plot``) for the samples so far; ``memory.csv`` already holds them."""
        if self._out_dir is None or not self.plot:
            return
        rows = self.read_csv()
        if rows:
            _plot_timeline(rows, [m for m in _METRICS if m in self._csv_columns], self.png_path)

    # -- out of memory ---------------------------------------------------------------------------
    def _dump_snapshot(self) -> Optional[Path]:
        if not torch.cuda.is_available() or self._out_dir is None:
            return None
        path = self._out_dir / f"memory_snapshot{self._suffix}.pickle"
        try:
            self._out_dir.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(path))
        except Exception as err:  # a failed dump must not hide the OOM itself
            log.warning(f"MemoryMonitor: could not write the memory snapshot: {err}")
            return None
        return path

    def oom_hint(self, trainer: pl.Trainer, snapshot: Optional[Path]) -> str:
        """One line: where the OOM happened, the knob to turn, and where the snapshot is."""
        phases = [s[0] for s in self._scopes if s[0] != "step"]
        phase = self._failed_phase or (phases[-1] if phases else None)
        where = self._stage + (f" of phase '{phase}'" if phase else "")
        names = {type(c).__name__ for c in trainer.callbacks}
        optimizers = [type(o).__name__ for o in trainer.optimizers]
        if self._stage == "optimizer step":
            if not any("8bit" in n for n in optimizers):
                knob = ("use an 8-bit or paged optimizer (model.optimizer.class_path: "
                        "bitsandbytes.optim.PagedAdamW8bit)")
            elif "OptimizerStateOffload" not in names:
                knob = "keep the optimizer state on the host between steps (callback lightning_mem.callbacks.OptimizerStateOffload)"
            else:
                knob = "shard or offload parameters and gradients (FSDP2 strategy with CPU offload, or DeepSpeed ZeRO-3 offload)"
        elif "ActivationOffload" not in names:
            knob = ("turn on activation checkpointing in the strategy, or add the callback "
                    "lightning_mem.callbacks.ActivationOffload")
        else:
            knob = "lower the token budget per micro-batch (data.max_tokens_per_batch) and raise accumulate_grad_batches"
        line = f"CUDA ran out of memory during the {where}: {knob}."
        if snapshot is not None:
            line += f" Memory snapshot: {snapshot} (open it at https://pytorch.org/memory_viz)."
        return line


@runtime_checkable
class PhaseObserver(Protocol):
    """A callback that measures named phases of a step: :class:`MemoryMonitor`, and the memory
    estimate's recorder (:mod:`lightning_mem.estimate`)."""

    def phase(self, name: str) -> contextlib.AbstractContextManager: ...


def memory_phase(trainer: Optional[pl.Trainer], name: str) -> contextlib.AbstractContextManager:
    """``with memory_phase(self.trainer, "rollout"):`` measures a phase in every callback of the
    trainer that observes phases (a :class:`PhaseObserver`), and does nothing without one (recipes
    call it unconditionally)."""
    stack = contextlib.ExitStack()
    for callback in getattr(trainer, "callbacks", None) or []:
        if isinstance(callback, PhaseObserver):
            stack.enter_context(callback.phase(name))
    return stack


def _parse_row(row: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {"time_s": float(row["time_s"]), "start_s": float(row["start_s"]), "event": row["event"],
                           "phase": row["phase"], "step": int(row["step"])}
    out.update({m: int(row[m]) for m in _METRICS if row.get(m)})
    return out


_DEVICE_METRICS = ("device_allocated_bytes", "device_reserved_bytes", "device_peak_allocated_bytes",
                   "device_peak_reserved_bytes", "device_used_bytes")
_HOST_METRICS = ("host_rss_bytes", "pinned_host_bytes")
_LABELLED_SPANS = 40  # name each phase span on the plot up to this many; beyond, the legend names them


def _plot_timeline(rows: list[dict[str, Any]], metrics: list[str], path: Path) -> None:
    """Memory over time from zero GiB: device memory (if any) above host memory, every sample
    (step ends and phase ends) in time order, phases as shaded, named spans."""
    # The object API with the Agg canvas: no pyplot, so no global backend is switched.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    panels = [(title, [m for m in names if m in metrics]) for title, names in
              (("device", _DEVICE_METRICS), ("host", _HOST_METRICS))]
    panels = [(title, names) for title, names in panels if names] or [("host", [])]
    fig = Figure(figsize=(11, 3.2 * len(panels) + 0.8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    samples = sorted(rows, key=lambda r: r["time_s"])
    phase_rows = [r for r in rows if r["event"] == "phase"]
    colors: dict[str, str] = {}
    for r in phase_rows:
        colors.setdefault(r["phase"], f"C{(len(colors) + 4) % 10}")
    for ax, (title, names) in zip(axes, panels):
        for i, metric in enumerate(names):
            points = [(r["time_s"], r[metric] / _GIB) for r in samples if metric in r]
            if points:
                ax.plot(*zip(*points), marker=".", ms=3, lw=1.2, color=f"C{i}", label=metric.removesuffix("_bytes"))
        for r in phase_rows:
            ax.axvspan(r["start_s"], r["time_s"], color=colors[r["phase"]], alpha=0.18, lw=0)
            if title == "device" and "device_peak_allocated_bytes" in r:
                ax.plot([r["time_s"]], [r["device_peak_allocated_bytes"] / _GIB], "v", color=colors[r["phase"]])
        ax.set_ylim(bottom=0)  # from zero: a flat line at 1.9 GiB must not look like a cliff
        ax.set_ylabel(f"{title} memory (GiB)")
        ax.grid(alpha=0.3)
    top = axes[0]
    if len(phase_rows) <= _LABELLED_SPANS:
        for r in phase_rows:
            top.annotate(r["phase"], xy=((r["start_s"] + r["time_s"]) / 2, 1.0), xycoords=("data", "axes fraction"),
                         ha="center", va="bottom", fontsize="x-small", color=colors[r["phase"]], rotation=90)
    phase_patches = [Patch(color=color, alpha=0.4, label=f"phase: {name}") for name, color in colors.items()]
    for ax in axes:
        handles = ax.get_legend_handles_labels()[0] + (phase_patches if ax is top else [])
        if handles:
            ax.legend(handles=handles, loc="lower right", fontsize="small", ncol=2)
    axes[-1].set_xlabel("seconds since fit start")
    fig.suptitle("memory per training step" + (" and phase" if phase_rows else ""))
    fig.savefig(path, dpi=100)
