"""MemoryMonitor: per-step and per-phase samples, CSV + PNG, logged metrics, the OOM path."""

from __future__ import annotations

import csv
import logging
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger, Logger
from memtest_utils import TinyLM, fit, lm_loss

from lightning_mem.callbacks import MemoryMonitor, memory_phase
from lightning_mem.callbacks import memory_monitor as module_under_test
from lightning_mem.run_dir import run_dir
from lightning_mem.settings import SettingError


class PhasedLM(TinyLM):
    """A training step in two named phases, as the PPO recipe will declare them."""

    def training_step(self, ids, batch_idx):
        with memory_phase(self.trainer, "rollout"), torch.no_grad():
            self.model(input_ids=ids)
        with memory_phase(self.trainer, "update"):
            return lm_loss(self.model, ids)


def _read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_writes_csv_png_and_logs_steps_and_phases(tmp_path) -> None:
    monitor = MemoryMonitor()
    logger = CSVLogger(tmp_path, name="run")
    trainer = fit(PhasedLM(), tmp_path, callbacks=[monitor], logger=logger)

    assert monitor.csv_path == Path(trainer.log_dir) / "memory.csv"
    rows = _read_csv(monitor.csv_path)
    assert [(r["event"], r["phase"]) for r in rows] == [("phase", "rollout"), ("phase", "update"), ("step", "step")] * 3
    assert [int(r["step"]) for r in rows if r["event"] == "step"] == [1, 2, 3]
    # CPU: host RSS only; no device columns are invented.
    assert set(rows[0]) == {"time_s", "start_s", "event", "phase", "step", "host_rss_bytes"}
    assert all(int(r["host_rss_bytes"]) > 10 * 2**20 for r in rows)
    assert all(float(r["start_s"]) <= float(r["time_s"]) for r in rows)
    png = Path(trainer.log_dir) / "memory.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000

    logged = _read_csv(Path(logger.log_dir) / "metrics.csv")
    keys = set(logged[0])
    assert {"memory/host_rss_bytes", "memory/rollout/host_rss_bytes", "memory/update/host_rss_bytes"} <= keys
    assert sum(1 for r in logged if r["memory/host_rss_bytes"]) == 3


class ManyPhasesLM(TinyLM):
    """More phases in one step than the monitor keeps in memory."""

    def training_step(self, ids, batch_idx):
        for _ in range(module_under_test._KEPT_ROWS + 44):
            with memory_phase(self.trainer, "tick"):
                pass
        return lm_loss(self.model, ids)


def test_a_long_run_keeps_a_bounded_number_of_samples_in_memory_and_all_in_the_csv(tmp_path) -> None:
    # A monitor that kept every sample would itself make host memory grow with the run's length
    # (about 2 KB per PPO step: benchmarks/host_memory_long_run.py found it).
    monitor = MemoryMonitor()
    trainer = fit(ManyPhasesLM(), tmp_path, steps=1, callbacks=[monitor], logger=CSVLogger(tmp_path, name="run"))
    kept = module_under_test._KEPT_ROWS
    assert len(monitor.rows) == kept and monitor.rows[-1]["event"] == "step"
    rows = _read_csv(monitor.csv_path)
    assert len(rows) == kept + 44 + 1 and rows[0]["phase"] == "tick"
    assert monitor.read_csv()[-1] == dict(monitor.rows[-1])
    assert (Path(trainer.log_dir) / "memory.png").is_file()


def test_phase_api_is_a_no_op_without_a_monitor_and_checks_names(tmp_path) -> None:
    with memory_phase(None, "rollout"):
        pass
    with memory_phase(Trainer(logger=False, default_root_dir=tmp_path), "rollout"):
        pass
    monitor = MemoryMonitor()
    with monitor.phase("outer"), monitor.phase("inner"):  # usable outside a trainer, nests
        pass
    assert [r["phase"] for r in monitor.rows] == ["inner", "outer"]
    with pytest.raises(ValueError, match="must be letters"):  # a name in code: a programming error
        with monitor.phase("roll out/1"):
            pass
    with pytest.raises(SettingError, match=r"^`trainer.callbacks\[MemoryMonitor\].init_args.every_n_steps` must be"
                                           r" >= 1, got 0$"):
        MemoryMonitor(every_n_steps=0)


def _fake_cuda_snapshot(monkeypatch) -> list[str]:
    """Pretend CUDA is there for the OOM handler only: the library's calls stay as they are."""
    dumped: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def dump(filename: str) -> None:
        dumped.append(filename)
        Path(filename).write_bytes(b"snapshot")

    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", dump)
    return dumped


def _oom_records(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == module_under_test.__name__ and r.levelno == logging.ERROR]


def test_oom_in_a_phase_dumps_a_snapshot_hints_and_reraises(tmp_path, monkeypatch, caplog) -> None:
    dumped: list[str] = []

    class OutOfMemoryInRollout(TinyLM):
        def training_step(self, ids, batch_idx):
            with memory_phase(self.trainer, "rollout"):
                dumped.extend(_fake_cuda_snapshot(monkeypatch))  # the list is filled on dump
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monitor = MemoryMonitor()
    with caplog.at_level(logging.ERROR), pytest.raises(torch.OutOfMemoryError, match="Tried to allocate"):
        fit(OutOfMemoryInRollout(), tmp_path, callbacks=[monitor])
    snapshot = tmp_path / "memory_snapshot.pickle"
    assert snapshot.read_bytes() == b"snapshot"
    (hint,) = _oom_records(caplog)
    assert "forward of phase 'rollout'" in hint
    assert "activation checkpointing" in hint and "ActivationOffload" in hint
    assert str(snapshot) in hint and "pytorch.org/memory_viz" in hint
    assert (tmp_path / "memory.csv").exists()  # the timeline up to the error


def test_oom_in_the_optimizer_step_names_the_optimizer_knob(tmp_path, monkeypatch, caplog) -> None:
    class OutOfMemoryInStep(Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            _fake_cuda_snapshot(monkeypatch)
            raise torch.OutOfMemoryError("CUDA out of memory.")

    with caplog.at_level(logging.ERROR), pytest.raises(torch.OutOfMemoryError):
        fit(TinyLM(), tmp_path, callbacks=[MemoryMonitor(), OutOfMemoryInStep()])
    (hint,) = _oom_records(caplog)
    assert "during the optimizer step" in hint and "bitsandbytes.optim.PagedAdamW8bit" in hint


def test_other_errors_get_no_hint(tmp_path, caplog) -> None:
    class Failing(TinyLM):
        def training_step(self, ids, batch_idx):
            raise ValueError("not memory")

    with caplog.at_level(logging.ERROR), pytest.raises(ValueError):
        fit(Failing(), tmp_path, callbacks=[MemoryMonitor()])
    assert _oom_records(caplog) == []


def test_record_history_starts_and_stops_with_cuda_and_warns_without(tmp_path, monkeypatch) -> None:
    trainer = Trainer(accelerator="cpu", logger=False, default_root_dir=tmp_path)
    module_under_test._warning_cache.clear()
    with pytest.warns(UserWarning, match="does nothing without CUDA"):
        MemoryMonitor(record_history=True).setup(trainer, TinyLM(), "fit")

    calls: list[dict] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kwargs: calls.append(kwargs))
    monitor = MemoryMonitor(record_history=True, history_max_entries=123)
    monitor.setup(trainer, TinyLM(), "fit")
    monitor.teardown(trainer, TinyLM(), "fit")
    assert calls == [{"max_entries": 123}, {"enabled": None}]


@pytest.mark.gpu
def test_cuda_samples_device_memory_and_phase_peaks(tmp_path) -> None:
    class BigPhase(TinyLM):
        def training_step(self, ids, batch_idx):
            with memory_phase(self.trainer, "spike"):
                spike = torch.empty(256 * 2**20, dtype=torch.uint8, device=self.device)
                del spike
            return lm_loss(self.model, ids)

    monitor = MemoryMonitor()
    fit(BigPhase(), tmp_path, callbacks=[monitor], accelerator="cuda")
    rows = _read_csv(monitor.csv_path)
    for row in rows:
        assert int(row["device_reserved_bytes"]) >= int(row["device_allocated_bytes"]) > 0
        assert int(row["device_peak_allocated_bytes"]) >= int(row["device_allocated_bytes"])
        # The allocator holds at least what it handed out, at its peak too.
        assert int(row["device_peak_reserved_bytes"]) >= max(int(row["device_peak_allocated_bytes"]),
                                                             int(row["device_reserved_bytes"]))
    spikes = [int(r["device_peak_allocated_bytes"]) for r in rows if r["phase"] == "spike"]
    steps = [int(r["device_peak_allocated_bytes"]) for r in rows if r["event"] == "step"]
    assert all(p >= 256 * 2**20 for p in spikes)
    assert all(s >= p for s, p in zip(steps, spikes))  # a step's peak includes its phases' peaks


class RemoteLogger(Logger):
    """Stands in for MLflow and W&B: a name and a run id from the service, no local log_dir."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[dict] = []

    @property
    def name(self) -> str:
        return "experiment 7"

    @property
    def version(self) -> str:
        return "run/3f2a"

    def log_metrics(self, metrics, step=None) -> None:
        self.metrics.append(metrics)

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass


def test_remote_logger_run_gets_its_own_folder_under_the_root(tmp_path) -> None:
    monitor = MemoryMonitor()
    logger = RemoteLogger()
    trainer = fit(PhasedLM(), tmp_path, callbacks=[monitor], logger=logger)
    run = tmp_path / "experiment_7" / "run_3f2a"  # <default_root_dir>/<logger.name>/<logger.version>
    assert run_dir(trainer) == run and monitor.csv_path == run / "memory.csv"
    assert (run / "memory.csv").is_file() and (run / "memory.png").is_file()
    assert any("memory/host_rss_bytes" in m for m in logger.metrics)


def test_plot_is_zero_based_with_device_and_host_panels_and_named_phases(tmp_path) -> None:
    gib = 2**30
    rows = []
    for step in range(3):
        t = 10.0 * step
        for name, (start, end) in {"rollout": (0, 4), "score": (4, 5), "train": (5, 9)}.items():
            rows.append({"time_s": t + end, "start_s": t + start, "event": "phase", "phase": name, "step": step,
                         "device_allocated_bytes": 5 * gib, "device_peak_allocated_bytes": 7 * gib,
                         "host_rss_bytes": 3 * gib})
        rows.append({"time_s": t + 9.5, "start_s": t, "event": "step", "phase": "step", "step": step,
                     "device_allocated_bytes": 5 * gib, "device_peak_allocated_bytes": 7 * gib, "host_rss_bytes": 3 * gib})
    figures = []
    monkey = pytest.MonkeyPatch()
    from matplotlib.figure import Figure

    original = Figure.savefig
    monkey.setattr(Figure, "savefig", lambda self, *a, **k: (figures.append(self), original(self, *a, **k))[1])
    try:
        module_under_test._plot_timeline(rows, ["device_allocated_bytes", "device_peak_allocated_bytes", "host_rss_bytes"],
                                         tmp_path / "m.png")
    finally:
        monkey.undo()
    (fig,) = figures
    device, host = fig.axes
    assert device.get_ylabel() == "device memory (GiB)" and host.get_ylabel() == "host memory (GiB)"
    assert device.get_ylim()[0] == 0 and host.get_ylim()[0] == 0
    assert [t.get_text() for t in device.texts] == ["rollout", "score", "train"] * 3
    labels = [t.get_text() for t in device.get_legend().get_texts()]
    assert {"phase: rollout", "phase: score", "phase: train", "device_allocated"} <= set(labels)
    assert host.get_legend_handles_labels()[1] == ["host_rss"]
