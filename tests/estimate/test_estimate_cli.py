"""The estimator's command line, sizes, tiers and verdicts, and the FitCheck callback's plumbing."""

from __future__ import annotations

import json
import resource
import subprocess
import sys

import pytest

from lightning_mem.callbacks.fit_check import FitCheck, config_from_argv
from lightning_mem.estimate import parse_size, tier_of, usable_bytes
from lightning_mem.estimate.__main__ import main


def test_parse_size():
    assert parse_size("24GiB") == 24 << 30
    assert parse_size("80GB") == 80 * 10**9
    assert parse_size("1024") == 1024
    with pytest.raises(ValueError, match="--device-memory"):
        parse_size("lots")


def test_tier_from_header_or_name(tmp_path):
    cfg = tmp_path / "x.yaml"
    cfg.write_text("# tier: 8x80GB\nseed_everything: 1\n")
    assert (tier_of(cfg).gpus, tier_of(cfg).memory_bytes) == (8, 80 << 30)
    named = tmp_path / "model_1x24gb.yaml"
    named.write_text("seed_everything: 1\n")
    assert (tier_of(named).gpus, tier_of(named).memory_gb) == (1, 24)
    assert tier_of(tmp_path / "x_cpu.yaml") is None


def test_margin():
    assert usable_bytes(24 << 30) == int((24 << 30) * 0.9) - (1 << 30)


def test_json_output_and_exit_code(capsys):
    code = main(["--config", "configs/sft/tiny_cpu.yaml", "--device-memory", "64MiB", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 1 and out["fits"] is False  # the tiny step needs ~120 MiB
    assert out["device_peak_bytes"] == max(p["device_peak_bytes"] for p in out["phases"])
    phase = out["phases"][0]
    assert set(phase["device_breakdown_bytes"]) == {
        "weights", "gradients", "optimizer_state", "activations", "logits", "kv_cache", "other"}
    assert sum(phase["device_breakdown_bytes"].values()) == phase["device_peak_bytes"]
    assert out["margin"]["fraction"] == 0.1 and out["usable_device_bytes"] == usable_bytes(64 << 20)


def test_bad_override_fails_before_any_model():
    with pytest.raises(SystemExit):
        main(["--config", "configs/sft/tiny_cpu.yaml", "--data.max_lenght", "8"])


def test_llama_8b_1x24gb_host_memory():
    # The 8B estimate builds nothing real: measured ~15 s and ~0.45 GB peak RSS on the 2-core CI machine.
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    done = subprocess.run(
        [sys.executable, "-m", "lightning_mem.estimate", "--config", "configs/sft/llama-3.1-8b_1x24gb.yaml", "--json"],
        capture_output=True, text=True, timeout=900,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    peak_kb = max(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, before)
    assert peak_kb < 3 * 1024 * 1024
    assert json.loads(done.stdout)["fits"] is True


def test_config_from_argv():
    argv = ["fit", "--config", "c.yaml", "--data.max_length", "8", "--ckpt_path", "last"]
    assert config_from_argv(argv) == ("c.yaml", ["--data.max_length", "8"])


def test_fit_check_report_warns_with_suggestions():
    result = {
        "phases": [{"phase": "train", "device_peak_bytes": 30 << 30}], "usable_device_bytes": 20 << 30,
        "fits": False, "margin": {"what": "m"},
        "suggestions": [{"what": "smaller", "overrides": ["--a=1"], "device_peak_bytes": 10 << 30, "fits": True}],
    }
    with pytest.warns(UserWarning, match=r"(?s)train 30.0 GiB.*--a=1"):
        FitCheck().report(result)
    with pytest.raises(RuntimeError, match="run out of memory"):
        FitCheck(fail=True).report(result)


def test_suggest_re_estimates_until_it_fits(capsys):
    # Tiny SFT needs ~0.12 GiB; a 1.2 GiB "card" leaves 0.08 GiB after the margin.
    code = main(["--config", "configs/sft/tiny_cpu.yaml", "--device-memory", "1.2GiB", "--suggest", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 1 and out["fits"] is False
    fitting = [s for s in out["suggestions"] if s["fits"]]
    assert fitting, out["suggestions"]
    assert all(s["device_peak_bytes"] <= out["usable_device_bytes"] for s in fitting)
    assert any("ActivationCheckpointing" in " ".join(s["overrides"]) for s in fitting)
