"""benchmarks/gpu/step_time.py on its CPU side: the same driver with --device cpu on the tiny model
runs the bare loop and the recipe on the same batches and writes rows with their ratio; Liger,
which needs CUDA, is a row that says why it did not run; Liger runs come last."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from benchmarks import step_time as cpu_bench
from benchmarks.gpu import step_time
from lightning_mem.assets import HUB_ASSETS
from tests.helpers import TINY_MODEL


def test_the_cpu_side_writes_the_bare_loop_and_the_recipe_beside_it(tmp_path):
    argv = ["--device", "cpu", "--models", str(TINY_MODEL), "--rows", "2", "--tokens", "32", "--steps", "2",
            "--warmup", "1", "--precision", "32-true", "--options", "liger:rope,none", "--out", str(tmp_path)]
    assert step_time.main(argv) == 0
    rows = json.loads((tmp_path / "gpu_step_time.json").read_text())
    assert [(r["run"], r["options"]) for r in rows] == [("bare loop (hf loss)", "none"), ("recipe", "none"),
                                                        ("recipe", "liger:rope")]
    bare, recipe, liger = rows
    for row in (bare, recipe):
        assert row["outcome"] == "ran" and row["steps"] == 2 and row["median_ms"] > 0
        assert row["tokens_per_s"] == pytest.approx(2 * 32 / (row["median_ms"] / 1e3))
        assert row["peak_gib"] is None  # no device counter on a CPU: nothing invented
    assert recipe["time_ratio"] == pytest.approx(recipe["median_ms"] / bare["median_ms"])
    assert liger["outcome"].startswith("skipped: Liger's kernels are Triton kernels and need a CUDA device")
    with (tmp_path / "gpu_step_time.csv").open() as f:
        assert [r["options"] for r in csv.DictReader(f)] == ["none", "none", "liger:rope"]
    table = (tmp_path / "gpu_step_time.md").read_text()
    assert step_time.TABLE_HEAD in table and "| recipe | none |" in table


def test_liger_runs_last_and_models_are_the_shipped_architectures():
    assert step_time.option_order(["liger", "none", "liger:rope", "compile+liger", "no-shared-casts", "compile"]) == [
        "none", "no-shared-casts", "compile", "liger", "liger:rope", "compile+liger"]
    assert step_time.model_folder("Qwen/Qwen2.5-1.5B") == str(HUB_ASSETS / "Qwen/Qwen2.5-1.5B")
    assert all((HUB_ASSETS / name / "config.json").is_file() for name in step_time.MODELS)
    with pytest.raises(FileNotFoundError, match="neither a config folder nor one of assets/hub's"):
        step_time.model_folder("Qwen/NoSuchModel")


def test_an_option_set_is_parts_and_each_part_is_a_callback_or_the_recipe_without_shared_casts():
    from lightning_mem.callbacks import CompileBlocks, LigerKernels, SharedCasts, TrainingDtypes

    assert cpu_bench.option_parts("none") == [] and cpu_bench.option_parts("compile+liger") == ["compile", "liger"]
    (some,) = cpu_bench._callbacks("liger:rms_norm+liger:rope")
    assert isinstance(some, LigerKernels) and some.kernels == {"rms_norm": True, "swiglu": False, "rope": True}
    every, compiled = cpu_bench._callbacks("compile+liger")  # Liger first: the compiled blocks trace its kernels
    assert isinstance(every, LigerKernels) and all(every.kernels.values()) and isinstance(compiled, CompileBlocks)
    assert cpu_bench._callbacks("no-shared-casts") == []
    assert cpu_bench._recipe_class("compile").__name__ == "SFTModule"
    without = cpu_bench._recipe_class("liger:swiglu+no-shared-casts")(str(TINY_MODEL), export_dir=None)
    plain = cpu_bench._recipe_class("none")(str(TINY_MODEL), export_dir=None)
    assert [type(c) for c in plain.configure_callbacks()] == [TrainingDtypes, SharedCasts]
    assert [type(c) for c in without.configure_callbacks()] == [TrainingDtypes]
    with pytest.raises(ValueError, match=r"unknown options \['liger:flce'\]"):
        cpu_bench.option_parts("liger:flce")


def test_bad_arguments_stop_before_any_model_is_built(capsys):
    with pytest.raises(SystemExit):
        step_time.main(["--device", "cpu", "--options", "turbo"])
    assert "--options: unknown options ['turbo'] in 'turbo'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        step_time.main(["--device", "cpu", "--options", "none,liger+liger:rope"])
    assert "'liger' is every Liger kernel" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            step_time.main([])
        assert "no CUDA device here" in capsys.readouterr().err


def test_the_batches_are_whole_rows_with_the_loss_on_the_completion():
    (batch,) = cpu_bench.synthetic_batches(1, rows=3, tokens=10, vocab_size=50)
    assert batch["input_ids"].shape == (3, 10) and bool(batch["attention_mask"].all())
    assert bool((batch["labels"][:, :5] == -100).all()) and torch.equal(batch["labels"][:, 5:], batch["input_ids"][:, 5:])
    assert int(batch["input_ids"].max()) < 50


def test_the_step_profile_writes_each_sides_ops_and_the_recipe_finds_its_targets_on_the_host(tmp_path):
    from benchmarks.gpu import profile_step

    assert profile_step.main(["--device", "cpu", "--model", str(TINY_MODEL), "--rows", "2", "--tokens", "32",
                              "--warmup", "2", "--active", "2", "--precision", "32-true", "--out", str(tmp_path),
                              "--table-rows", "5"]) == 0
    for side in ("bare", "recipe"):
        text = (tmp_path / f"profile_{side}.txt").read_text()
        assert text.startswith(f"{side}: ") and "aten::" in text and "Self CPU time total" in text and "host synchronisation events" in text
    # The batches carry their targets (as the recipe's datamodule makes them): no nonzero in the step.
    assert "aten::nonzero" not in (tmp_path / "profile_recipe.txt").read_text()
