"""benchmarks/host_memory_long_run.py's analysis: the slope it reports is the growth per step
after warm-up, whatever the warm-up did."""

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "host_memory_long_run.py"
_spec = importlib.util.spec_from_file_location("host_memory_long_run", _PATH)
long_run = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(long_run)

MIB = 2**20


def test_a_flat_run_after_a_warm_up_climb_has_zero_slope(tmp_path):
    rss = [400 * MIB + i * MIB for i in range(20)] + [540 * MIB + (4096 if i % 2 else -4096) for i in range(100)]
    stats = long_run.analyse(rss, warmup=20 / 120)
    assert stats["warmup_steps"] == 20
    assert abs(stats["slope_kib_per_step"]) < 0.2
    long_run.plot(rss, stats, tmp_path / "rss.png", "synthetic")
    assert (tmp_path / "rss.png").stat().st_size > 0


def test_a_leak_shows_as_its_bytes_per_step():
    rss = [500 * MIB + i * 10 * 1024 for i in range(200)]
    stats = long_run.analyse(rss, warmup=0.2)
    assert stats["slope_kib_per_step"] == pytest.approx(10.0)
    assert stats["fitted_growth_mib"] == pytest.approx(10 * 159 / 1024)


def test_too_few_steps_after_warm_up_are_refused():
    with pytest.raises(ValueError, match="run more iterations"):
        long_run.analyse([MIB] * 10, warmup=0.5)


def test_the_step_samples_are_read_from_the_monitor_csv(tmp_path):
    csv = tmp_path / "memory.csv"
    csv.write_text("time_s,start_s,event,phase,step,host_rss_bytes\n0.1,0,phase,rollout,0,100\n0.2,0,step,step,8,200\n"
                   "0.3,0,step,step,16,300.0\n")
    assert long_run.step_rss(csv) == [200, 300]
