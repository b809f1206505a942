"""``fit --auto_fit true``: the estimate runs on the run's own command line, the cheapest fitting
suggestion is applied before any model loads and said in the log and in config.yaml; without a
device to fit into it is an error naming ``device_memory``."""

from __future__ import annotations

import logging

import pytest
import torch
import yaml

import recipes.sft as sft
from lightning_mem import auto_fit
from lightning_mem.settings import SettingError
from tests.helpers import REPO

CONFIG = str(REPO / "configs" / "sft" / "tiny_cpu.yaml")
GiB = 1 << 30


def _sft_args(root, *extra):
    return ["fit", "--config", CONFIG, f"--trainer.default_root_dir={root}", "--trainer.enable_progress_bar=false",
            "--trainer.limit_val_batches=0", "--trainer.limit_train_batches=2", "--trainer.max_epochs=1",
            "--model.export_dir=null", *extra]


def test_the_estimate_gets_the_runs_command_line_without_the_auto_fit_keys():
    argv = ["fit", "--config", "a.yaml", "--config=b.yaml", "--data.max_length", "8", "--auto_fit", "true",
            "--device_memory=2GiB", "--ckpt_path", "last", "--trainer.callbacks+=X", "--auto_fit_applied=old"]
    assert auto_fit.split_command_line(argv) == ("a.yaml", ["--config=b.yaml", "--data.max_length", "8", "--trainer.callbacks+=X"])
    with pytest.raises(SettingError, match=r"`auto_fit: true` needs the run's --config"):
        auto_fit.split_command_line(["fit", "--model.name_or_path", "x"])


def test_the_budget_is_device_memory_or_the_cuda_device():
    assert auto_fit.device_budget("24GiB") == (24 * GiB, "device_memory=24GiB")
    assert auto_fit.device_budget("2000000000") == (2_000_000_000, "device_memory=2000000000")
    with pytest.raises(SettingError, match=r"^`device_memory`: cannot read 'lots' as a size"):
        auto_fit.device_budget("lots")
    # A device the estimate's reserve alone fills: nothing is left for the run, said as such.
    with pytest.raises(SettingError, match=r"^`device_memory`: 1GiB leaves nothing for the run: the estimate reserves"
                                           r" 1.10 GiB of a device that size \(10% of the device .* \+ 1 GiB for the CUDA"
                                           r" context\); give at least 1.12 GiB$"):
        auto_fit.device_budget("1GiB")
    assert auto_fit.device_budget("1.12GiB")[0] == int(1.12 * GiB)
    if not torch.cuda.is_available():
        with pytest.raises(SettingError, match=r"there is no CUDA device here: give the budget with `device_memory`"):
            auto_fit.device_budget(None)


def test_the_cheapest_fitting_suggestion_is_chosen_and_none_fitting_is_an_error():
    fits = {"fits": True, "device_peak_bytes": GiB, "usable_device_bytes": 2 * GiB}
    assert auto_fit.choose(fits) is None
    assert auto_fit.describe(fits, None, "device_memory=4GiB") == \
        "fits as configured: estimated peak 1.00 GiB of 2.00 GiB usable on device_memory=4GiB"
    tight = {"fits": False, "device_peak_bytes": 3 * GiB, "usable_device_bytes": 2 * GiB,
             "device_memory_bytes": 3.5 * GiB, "margin": {"what": "the margin"}, "suggestions": [
        {"what": "a", "overrides": ["--a=1"], "device_peak_bytes": 2.5 * GiB, "fits": False},
        {"what": "b", "overrides": ["--b=1"], "device_peak_bytes": GiB, "fits": True, "cost": {"text": "+1 forward"}},
        {"what": "c", "overrides": ["--c=1"], "device_peak_bytes": GiB // 2, "fits": True}]}
    chosen = auto_fit.choose(tight)
    assert chosen["what"] == "b"  # the estimator lists them cheapest first
    assert auto_fit.describe(tight, chosen, "H100 (cuda:0)") == (
        "applied 'b' (--b=1): estimated peak 3.00 -> 1.00 GiB of 2.00 GiB usable on H100 (cuda:0); cost: +1 forward")
    hopeless = {**tight, "suggestions": [tight["suggestions"][0], {"what": "d", "overrides": [], "error": "no"}]}
    with pytest.raises(SettingError, match=r"^`auto_fit: true`: the run's estimated peak 3.00 GiB exceeds the 2.00 GiB"
                                           r" usable of 3.50 GiB \(the rest is the estimate's reserve: the margin\),"
                                           r" and no suggestion fits \(a: 2.50 GiB; d: no\)"):
        auto_fit.choose(hopeless)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is a budget")
def test_auto_fit_on_cpu_without_a_budget_names_the_key_before_any_model(tmp_path, monkeypatch):
    monkeypatch.setattr(sft, "load_causal_lm", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(SettingError, match=r"`device_memory`"):
        sft.main(_sft_args(tmp_path, "--auto_fit=true"))


def test_auto_fit_applies_the_cheapest_suggestion_that_fits_and_says_so(tmp_path, caplog):
    # The tiny SFT step needs ~0.12 GiB; a 1.2 GiB "card" leaves 0.08 GiB after the margin: smaller
    # micro-batches alone (~0.09 GiB) do not fit, activation checkpointing (~0.07 GiB) does.
    with caplog.at_level(logging.INFO):
        cli = sft.main(_sft_args(tmp_path, "--auto_fit=true", "--device_memory=1.2GiB"))
    applied = cli.config["fit"]["auto_fit_applied"]
    assert applied.startswith("applied 'activation checkpointing of every block'") and "cost: +1 forward" in applied
    assert any(f"auto_fit: {applied}" in r.getMessage() for r in caplog.records)
    assert "ActivationCheckpointing" in [type(c).__name__ for c in cli.trainer.callbacks]  # the run is the suggested one
    saved = yaml.safe_load(next(tmp_path.glob("**/config.yaml")).read_text())
    assert saved["auto_fit_applied"] == applied
    assert any(c["class_path"].endswith("ActivationCheckpointing") for c in saved["trainer"]["callbacks"])
