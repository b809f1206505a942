"""The GPU machine's one command (benchmarks/gpu/), on its CPU side: which configs it runs, the cap
arithmetic, the overrides that make a tier config a short offline run, the generated data, the
per-phase recording on a tiny run, the rows it writes, and the wheel download command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import yaml

from benchmarks.gpu import ladder, tiers, wheels
from lightning_mem.assets import HUB_ASSETS
from lightning_mem.models import load_tokenizer
from tests.helpers import HANG_GUARD_S, REPO, TINY_MODEL

GiB = 1 << 30


def test_the_runs_are_every_one_gpu_tier_config():
    found = tiers.single_gpu_configs()
    named = sorted(p for p in (REPO / "configs").glob("*/*.yaml") if "_1x" in p.name)
    assert found == named and len(found) >= 3
    assert {p.parent.name for p in found} == set(tiers.RECIPES)  # every recipe with a 1-GPU config can run
    assert tiers.single_gpu_configs(only=["sft/qwen2.5-1.5b_1x24gb"]) == [REPO / "configs/sft/qwen2.5-1.5b_1x24gb.yaml"]
    assert tiers.single_gpu_configs(only=["8x80gb"]) == []  # a multi-GPU tier is never run capped to one card


def test_the_cap_gives_the_run_the_tiers_card():
    assert tiers.cap_fraction(24 * GiB, 80 * GiB) == (0.3, "capped to 24 of 80.0 GiB")
    fraction, words = tiers.cap_fraction(80 * GiB, 140 * GiB)  # an 80 GB tier on an H200
    assert fraction == pytest.approx(4 / 7) and words == "capped to 80 of 140.0 GiB"
    # An H100 reports a little less than 80 GiB: the run gets the whole card, and the row says so.
    assert tiers.cap_fraction(80 * GiB, 79 * GiB + 200 * 2**20) == (
        1.0, "uncapped: the card's 79.2 GiB are no more than the tier's 80 GiB")
    with pytest.raises(ValueError, match="positive"):
        tiers.cap_fraction(24 * GiB, 0)


def test_the_estimate_beside_is_the_config_headers():
    assert set(tiers.header_estimate(REPO / "configs/sft/qwen2.5-1.5b_1x24gb.yaml")) == {"train"}
    ppo = tiers.header_estimate(REPO / "configs/ppo/qwen2.5-0.5b-instruct_1x24gb.yaml")
    assert set(ppo) == {"rollout", "score", "train"} and all(v > 0 for v in ppo.values())
    assert tiers.header_estimate(REPO / "configs/sft/tiny_cpu.yaml") == {}
    assert tiers.needs_missing_package({"trainer": {"strategy": "auto"}}) is None


def test_generated_data_fills_the_configs_largest_micro_batch():
    from lightning_mem.data.chat import encode_prompt, row_to_messages, row_to_prompt_messages
    from lightning_mem.data.sft import tokenize_example

    tokenizer = load_tokenizer(str(TINY_MODEL))
    for row in tiers.sft_rows(3, 300, tokenizer):
        example, truncated = tokenize_example(row_to_messages(row), tokenizer, 300)
        assert truncated and len(example["input_ids"]) == 300
    system = "Answer with the number only."
    lengths = [len(encode_prompt(row_to_prompt_messages({**row, "system": system}), tokenizer))
               for row in tiers.prompt_rows(6, 200, tokenizer, system_prompt=system)]
    assert all(195 <= n <= 200 for n in lengths), lengths  # as long as the tokenizer allows, never longer


@pytest.mark.parametrize("config", ["sft/qwen2.5-1.5b_1x24gb.yaml", "qlora/llama-3.1-8b_1x24gb.yaml",
                                    "ppo/qwen2.5-0.5b-instruct_1x24gb.yaml", "dpo/qwen2.5-1.5b_1x24gb.yaml",
                                    "reward_model/qwen2.5-1.5b_1x24gb.yaml",
                                    "sft/llama-3.2-1b-instruct_distill_llama-3.1-8b-instruct_1x24gb.yaml"])
def test_overrides_make_a_tier_config_a_short_offline_run(config, tmp_path):
    from lightning.pytorch import LightningDataModule, LightningModule

    from benchmarks.gpu.probe import TierProbe
    from lightning_mem.callbacks import FitCheck, MemoryMonitor
    from lightning_mem.cli import RecipeCLI

    path = REPO / "configs" / config
    raw = yaml.safe_load(path.read_text())
    args = tiers.overrides_for(path, tmp_path, steps=2)
    recipe = __import__(tiers.RECIPES[path.parent.name], fromlist=["main"])
    module = next(v for v in vars(recipe).values() if isinstance(v, type) and issubclass(v, LightningModule)
                  and v.__module__ == recipe.__name__)
    data = next(v for v in vars(recipe).values() if isinstance(v, type) and issubclass(v, LightningDataModule))
    # Parsed by the recipe's own CLI (on CPU here: the accelerator is the only key the test adds).
    cli = RecipeCLI(module, data, args=["--config", str(path), *args, "--trainer.accelerator=cpu"], run=False,
                    save_config_callback=None)
    folder = Path(cli.model.hparams.name_or_path)
    assert folder.is_relative_to(tmp_path)  # built at random from the shipped architecture, no download
    assert json.loads((folder / "config.json").read_text()) == json.loads(
        (HUB_ASSETS / raw["model"]["name_or_path"] / "config.json").read_text())
    assert (folder / "tokenizer.json").is_file()
    kinds = [type(c) for c in cli.trainer.callbacks]
    assert TierProbe in kinds and MemoryMonitor in kinds and FitCheck not in kinds
    accumulate = 1 if path.parent.name == "ppo" else raw["trainer"]["accumulate_grad_batches"]
    assert cli.trainer.limit_train_batches == 2 * accumulate and cli.trainer.max_epochs == 1
    assert cli.trainer.max_steps == raw["trainer"].get("max_steps", -1)  # the LR schedule stays the config's
    assert cli.trainer.checkpoint_callback.save_last is False and cli.model.hparams.export_dir is None
    assert cli.trainer.limit_val_batches == 0
    teacher = (raw["model"].get("distillation") or {}).get("teacher")
    if teacher:  # a second model, built at random too
        assert Path(cli.model.hparams.distillation["teacher"]["name_or_path"]).is_relative_to(tmp_path)
    if path.parent.name in tiers.PAIR_RECIPES:  # generated preference pairs, each side past max_length
        rows = [json.loads(line) for line in Path(next(a for a in args if a.startswith("--data.train_file=")).split("=", 1)[1]).read_text().splitlines()]
        assert rows and all(set(row) == {"prompt", "chosen", "rejected"} and row["chosen"] != row["rejected"]
                            for row in rows)


def test_each_member_of_a_reward_model_ensemble_is_built_at_random(tmp_path):
    path = tmp_path / "ppo" / "ensemble_1x24gb.yaml"
    path.parent.mkdir()
    members = ["Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-1.5B-Instruct"]
    path.write_text(yaml.safe_dump({"model": {"name_or_path": members[0], "reward_model": {"name_or_path": members}},
                                    "data": {"batch_size": 2, "max_prompt_length": 32}}))
    args = tiers.overrides_for(path, tmp_path / "work", steps=1)
    listed = next(a for a in args if a.startswith("--model.reward_model.name_or_path="))
    folders = yaml.safe_load(listed.split("=", 1)[1])
    assert len(folders) == 2 and all(Path(f).is_relative_to(tmp_path / "work") for f in folders)
    for member, folder in zip(members, folders):
        assert json.loads((Path(folder) / "config.json").read_text()) == json.loads(
            (HUB_ASSETS / member / "config.json").read_text())


@pytest.fixture(scope="module")
def tiny_grpo_run(tmp_path_factory) -> dict:
    """The tiny GRPO config (from the tiny model rather than an SFT export), with an estimate
    header, one step in this process."""
    work = tmp_path_factory.mktemp("gpu_tiers")
    text = (REPO / "configs/ppo/tiny_cpu_grpo.yaml").read_text()
    text = "\n".join(f"  name_or_path: {TINY_MODEL}" if line.startswith("  name_or_path:") else line
                     for line in text.splitlines())
    config = work / "ppo" / "tiny_grpo.yaml"
    config.parent.mkdir()
    config.write_text("# estimated peak per rank (GiB): rollout=0.01 score=0.02 train=0.03\n" + text + "\n")
    return tiers.run_one(config, work, steps=1)


def test_each_estimated_phase_is_recorded_in_a_real_run(tiny_grpo_run):
    result = tiny_grpo_run
    assert result["outcome"] == "fits", result.get("error")
    assert {"rollout", "score", "train"} <= set(result["phases"])  # the estimate's phases, as the run names them
    assert all(result["phases"][name]["samples"] == 1 for name in ("rollout", "score", "train", "step"))
    assert result["phases"]["train"]["allocated"] is None  # no device counter on CPU: nothing invented
    speed = result["speed"]
    assert speed["batches"] == 1 and speed["median_s"] > 0
    assert speed["tokens_kind"] == "generated" and speed["tokens_per_s"] > 0 and speed["rollout_tokens_per_s"] > 0
    rows = tiers.table_rows(result)
    assert [row.split(" | ")[3] for row in rows] == ["rollout", "score", "train"]
    assert all(" | n/a | n/a | n/a | " in row for row in rows)  # measured bytes and ratio: none on CPU


def test_rows_put_each_phases_peaks_beside_its_estimate():
    result = {
        "config": "configs/sft/x_1x24gb.yaml", "tier": "1x24GB", "cap": "capped to 24 of 79.2 GiB", "outcome": "fits",
        "estimate_gib": {"train": 10.0},
        "phases": {"step": {"samples": 4, "allocated": int(10.5 * GiB), "reserved": 12 * GiB}},
        "speed": {"batches": 4, "median_s": 1.234, "tokens_per_s": 3319.4, "tokens_kind": "input"},
    }
    assert tiers.table_rows(result) == [
        "| `configs/sft/x_1x24gb.yaml` | 1x24GB, capped to 24 of 79.2 GiB | fits | train | 10.00 | 10.50 | 12.00 | 1.05 "
        "| 1.23 | 3,319 input |"]
    failed = {"config": "c.yaml", "tier": "1x24GB", "outcome": "out of memory", "error": "CUDA out of memory. Tried",
              "estimate_gib": {"rollout": 5.0, "train": 6.0},
              "phases": {"rollout": {"samples": 1, "allocated": 23 * GiB, "reserved": 24 * GiB},
                         "engine_wake": {"samples": 1, "allocated": GiB, "reserved": GiB}}}
    rows = tiers.table_rows(failed)
    assert [r.split(" | ")[3] for r in rows] == ["rollout", "train", "engine_wake"]
    assert "out of memory (CUDA out of memory. Tried)" in rows[0] and " | 5.00 | 23.00 | 24.00 | 4.60 | " in rows[0]
    assert " | 6.00 | n/a | n/a | n/a | " in rows[1]  # the run died before its train phase
    skipped = tiers.table_rows({"config": "z.yaml", "outcome": "skipped: needs deepspeed", "estimate_gib": {"train": 14.3}})
    assert skipped == ["| `z.yaml` | none, no cap | skipped: needs deepspeed | train | 14.30 | n/a | n/a | n/a | n/a | n/a |"]


def test_a_ppo_step_is_told_by_phase():
    batches = [{"seconds": 9.0, "tokens": 100, "tokens_kind": "generated", "rollout_tokens_per_s": 10.0,
                "phase_s": {"rollout": 8.0, "score": 0.5, "train": 0.5}},  # the first: warm-up, left out
               {"seconds": 4.0, "tokens": 100, "tokens_kind": "generated", "rollout_tokens_per_s": 50.0,
                "phase_s": {"rollout": 2.0, "score": 1.0, "train": 1.0}},
               {"seconds": 6.0, "tokens": 100, "tokens_kind": "generated", "rollout_tokens_per_s": 30.0,
                "phase_s": {"rollout": 4.0, "score": 1.0, "train": 1.0}}]
    speed = tiers.batch_speed(batches)
    assert speed["phase_s"] == {"rollout": 3.0, "score": 1.0, "train": 1.0} and speed["median_s"] == 5.0
    (row,) = tiers.phase_time_rows([{"config": "p.yaml", "speed": speed}])[-1:]
    assert row == "| p.yaml | 5.00 | rollout 3.00 s (60%), score 1.00 s (20%), train 1.00 s (20%) | 40 |"
    assert tiers.phase_time_rows([{"config": "s.yaml", "speed": tiers.batch_speed([batches[0] | {"phase_s": {}}])}]) == []


def test_run_sh_measures_a_config_and_writes_the_rows(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable, "WHEELS": str(tmp_path / "no-wheels"),
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run([str(REPO / "benchmarks/gpu/run.sh"), "--skip-tests", "--skip-step-time", "--skip-rollout",
                           "--config", "configs/sft/tiny_cpu.yaml",
                           "--steps", "1", "--workdir", str(tmp_path / "work")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "[1/1] sft/tiny_cpu.yaml: fits" in done.stdout
    assert done.stdout.strip().splitlines()[-2:] == ["== summary", "gpu_tiers: exit 0: tier configs: 1 configs: 1 fits"]
    (result,) = json.loads((tmp_path / "out/gpu_tiers.json").read_text())
    assert result["outcome"] == "fits" and result["speed"]["batches"] == 1 and result["speed"]["tokens_kind"] == "input"
    table = (tmp_path / "out/gpu_tiers.md").read_text()
    assert tiers.TABLE_HEAD in table and "| `configs/sft/tiny_cpu.yaml` | none, no cap | fits | step |" in table
    assert (tmp_path / "out/runs/sft--tiny_cpu/memory.csv").is_file()
    assert not list((tmp_path / "work/runs").glob("**/*.ckpt")) and not list((tmp_path / "work/runs").glob("**/export"))


def test_run_sh_names_a_config_outside_the_recipes(tmp_path):
    stray = tmp_path / "x.yaml"
    stray.write_text("{}\n")
    assert tiers.main(["--config", str(stray), "--out", str(tmp_path)]) == 2


def test_the_wheels_are_the_missing_packages_at_this_environments_versions(tmp_path):
    cmd = wheels.pip_command(tmp_path)
    assert cmd[1:4] == ["-m", "pip", "download"]
    for flag in ("--only-binary=:all:", "--no-deps"):
        assert flag in cmd
    assert cmd[cmd.index("--python-version") + 1] == "3.12" and cmd[cmd.index("--abi") + 1] == "cp312"
    assert cmd[cmd.index("--dest") + 1] == str(tmp_path)
    for name in ("bitsandbytes", "jsonargparse", "datasets", "typeshed-client", "docstring-parser"):
        assert f"{name}=={metadata.version(name)}" in cmd
    # Liger's kernels for the step-time benchmark's option rows (not installed on a CPU machine: unpinned).
    assert any(part.split("==")[0] == "liger-kernel" for part in cmd)


# ---------------------------------------------------------------- gpu tests, one process per file

_FAKE_GPU_TESTS = {
    "test_a_passes.py": "import pytest\n\n@pytest.mark.gpu\ndef test_ok():\n    assert True\n",
    "test_b_exits_from_c.py": ("import os, pytest\n\n@pytest.mark.gpu\ndef test_exit():\n    print('Error invalid device ordinal', flush=True)\n"
                              "    os._exit(1)\n"),
    "test_c_aborts.py": "import os, pytest\n\n@pytest.mark.gpu\ndef test_abort():\n    os.abort()\n",
    "test_d_fails.py": "import pytest\n\n@pytest.mark.gpu\ndef test_no():\n    assert 1 == 2\n\n@pytest.mark.gpu\ndef test_yes():\n    pass\n",
    "test_e_unmarked.py": "def test_cpu_only():\n    pass\n",
}


def test_each_gpu_test_file_runs_alone_and_a_crash_hides_nothing(tmp_path):
    from benchmarks.gpu import gpu_tests

    folder = tmp_path / "tests"
    folder.mkdir()
    for name, text in _FAKE_GPU_TESTS.items():
        (folder / name).write_text(text)
    assert [p.name for p in gpu_tests.gpu_test_files(folder)] == ["test_a_passes.py", "test_b_exits_from_c.py",
                                                                  "test_c_aborts.py", "test_d_fails.py"]
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu.gpu_tests", "--out", str(out), "--timeout", "120",
                           *(f"--file={p}" for p in gpu_tests.gpu_test_files(folder))],
                          cwd=REPO, capture_output=True, text=True, timeout=HANG_GUARD_S)
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 1, done.stdout + done.stderr
    assert lines[0].startswith("[1/4] ") and "test_a_passes.py: passed (1 passed)" in lines[0]
    assert "test_b_exits_from_c.py: crashed (no pytest summary)" in lines[1]
    assert "exit code 1; last line: Error invalid device ordinal" in lines[1]
    assert "test_c_aborts.py: crashed (no pytest summary)" in lines[2] and "killed by SIGABRT" in lines[2]
    assert "test_d_fails.py: failed (1 failed, 1 passed)" in lines[3] and "test_no" in lines[3]
    assert lines[4] == ("gpu tests: 4 files: 2 passed, 1 failed; not passed: "
                        f"{folder / 'test_b_exits_from_c.py'}, {folder / 'test_c_aborts.py'}, {folder / 'test_d_fails.py'}")
    assert (out / "gpu_tests.txt").read_text().splitlines()[-1] == lines[4]
    assert "Error invalid device ordinal" in (out / "gpu_tests/test_b_exits_from_c.log").read_text()


def test_a_file_past_its_time_limit_is_stopped_and_said(tmp_path):
    from benchmarks.gpu import gpu_tests

    result = gpu_tests.parse("tests/test_x.py", None, "tests/test_x.py .\n", 300.0)
    assert result.outcome == "timed out" and result.line().startswith("tests/test_x.py: timed out (no pytest summary)")
    assert gpu_tests.summary([result], 2) == "gpu tests: 1 of 2 files: no tests; not passed: tests/test_x.py"


def test_the_repositorys_gpu_test_files_are_found():
    from benchmarks.gpu import gpu_tests

    files = {str(p.relative_to(REPO)) for p in gpu_tests.gpu_test_files()}
    assert {"tests/test_offload.py", "tests/test_activation_offload_primitive.py", "tests/strategies/test_fsdp2.py"} <= files
    assert "tests/test_gpu_benchmark.py" not in files  # its fake files' marks are in strings, not a mark line


# ---------------------------------------------------------------- several tier configs on one card

def test_three_24gb_tiers_share_an_80gb_card_and_a_fourth_waits():
    card, tier = 85_520_809_984, 24 * GiB  # an H100 80GB's total_memory
    assert tiers.fits_beside([], tier, card)
    assert tiers.fits_beside([tier, tier], tier, card)  # 72 GiB of caps + 4 GiB of contexts < 79.6 GiB
    assert not tiers.fits_beside([tier, tier, tier], tier, card)
    assert not tiers.fits_beside([], 80 * GiB, card)


def test_a_paged_optimizer_or_a_whole_card_tier_runs_alone(tmp_path):
    paged = tmp_path / "paged.yaml"
    paged.write_text("model:\n  optimizer:\n    class_path: bitsandbytes.optim.PagedAdamW8bit\n")
    plain = tmp_path / "plain.yaml"
    plain.write_text("model:\n  optimizer:\n    class_path: torch.optim.AdamW\n")
    card = 80 * GiB
    assert "managed memory" in tiers.runs_alone(paged, 24 * GiB, card)
    assert tiers.runs_alone(plain, 24 * GiB, card) is None
    assert tiers.runs_alone(plain, 80 * GiB, card) == "its tier is the whole card"
    assert tiers.runs_alone(plain, 24 * GiB, None) == "its tier is the whole card"  # no CUDA card: one at a time


def test_the_tier_summary_counts_each_outcome():
    results = [{"outcome": "fits"}, {"outcome": "fits"}, {"outcome": "timed out after 540 s"},
               {"outcome": "skipped: needs deepspeed"}, {"outcome": "crashed"}]
    assert tiers.summary(results, 6) == "tier configs: 5 of 6 configs: 2 fits, 1 timed out, 1 skipped, 1 crashed"


_STUB_PYTHON = """#!/usr/bin/env bash
# Stands in for python in run.sh: the check passes, the gpu tests die of SIGABRT mid-run, the tiers fit.
case "$*" in
  "-") cat >/dev/null; echo "torch stub, CUDA: none" ;;
  *benchmarks.gpu.gpu_tests*) echo "[1/3] tests/test_a.py: passed (1 passed) in 1 s"; kill -ABRT $$ ;;
  *benchmarks.gpu.tiers*) echo "[1/1] sft/x.yaml: fits in 3 s"; echo "tier configs: 1 configs: 1 fits" ;;
  *benchmarks.gpu.step_time*) echo "step time: 2 models" ;;
  *benchmarks.gpu.rollout_speed*) echo "| 0.5b | static+compile | 15,040 |" ;;
esac
"""


def test_run_sh_ends_with_one_summary_after_a_step_crashes(tmp_path):
    stub = tmp_path / "python"
    stub.write_text(_STUB_PYTHON)
    stub.chmod(0o755)
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": str(stub), "WHEELS": str(tmp_path / "no-wheels")}
    done = subprocess.run([str(REPO / "benchmarks/gpu/run.sh")], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=HANG_GUARD_S)
    assert done.returncode == 1, done.stdout + done.stderr
    tail = done.stdout.strip().splitlines()[-6:]
    assert tail[0] == "== summary"
    assert tail[1] == "gpu_tests: exit 134: [1/3] tests/test_a.py: passed (1 passed) in 1 s"
    assert tail[2] == "gpu_tiers: exit 0: tier configs: 1 configs: 1 fits"
    assert tail[3] == "gpu_step_time: exit 0: step time: 2 models"
    assert tail[4] == "gpu_step_time_parts: exit 0: step time: 2 models"
    assert tail[5] == "rollout_speed: exit 0: | 0.5b | static+compile | 15,040 |"


# ---------------------------------------------------------------- torchtune's ladder, one config a rung


def _parsed(args: list[str]) -> dict:
    from lightning_mem.estimate.recipe_config import parse_config

    _, config, _ = parse_config("recipes.sft", args)
    as_dict = config.as_dict()
    as_dict.pop("config", None)
    return as_dict


def test_each_ladder_rung_config_is_the_top_config_with_that_rungs_overrides(tmp_path):
    setups = ladder.rungs()
    assert [ladder.rung_name(s) for s in setups] == [
        "packed", "chunked-ce", "activation-checkpointing", "optimizer-in-backward", "activation-offload", "adamw8bit"]
    for setup in setups:
        path = ladder.write_rung(setup, tmp_path)
        assert path.parent == tmp_path / "sft" and tiers.RECIPES.get(path.parent.name) == "recipes.sft"
        from lightning_mem.estimate.report import tier_of

        assert (tier_of(path).gpus, tier_of(path).memory_gb) == (1, 80)
        # The recipe's own CLI reads the rung file as it reads the top config with the overrides.
        # Each rung's runs go to a folder of its own (its logs and checkpoints follow).
        own_folder = f"--trainer.default_root_dir=runs/sft/llama-3.2-3b_1x80gb_ladder-{ladder.rung_name(setup)}"
        assert _parsed(["--config", str(path)]) == _parsed(["--config", str(ladder.TOP), *setup.overrides, own_folder])
    packed = yaml.safe_load((tmp_path / "sft" / "llama-3.2-3b_1x80gb_ladder-packed.yaml").read_text())
    assert packed["model"]["logits_chunk_size"] is None and packed["trainer"]["callbacks"] == []
    assert packed["model"]["optimizer"] == {"class_path": "torch.optim.AdamW", "init_args": {"lr": 2.0e-5}}


def test_a_ladder_override_that_is_not_a_key_value_pair_is_refused():
    with pytest.raises(ValueError, match="expected --key.path=value"):
        ladder.apply_overrides({}, ["model.logits_chunk_size=null"])
    with pytest.raises(SystemExit):
        ladder.main(["--only", "no-such-rung", "--write-only", "/tmp/x"])


def test_the_ladder_rows_set_each_measured_peak_beside_torchtunes_figure():
    setups = ladder.selected(["activation-offload", "adamw8bit"])
    results = [{"config": "/w/ladder_configs/sft/llama-3.2-3b_1x80gb_ladder-adamw8bit.yaml", "outcome": "fits",
                "phases": {"step": {"samples": 3, "allocated": int(15.84 * GiB), "reserved": 17 * GiB}},
                "speed": {"median_s": 1.5, "tokens_per_s": 5461.3}}]
    rows = ladder.ladder_rows(setups, results)
    assert [r["rung"] for r in rows] == ["activation-offload", "adamw8bit"]
    assert rows[0]["outcome"] == "not run" and rows[0]["ratio"] is None
    assert rows[1]["ratio"] == pytest.approx(int(15.84 * GiB) / int(17.6 * GiB))
    text = ladder.markdown(rows, date="2026-11-26", device="H100", command="c")
    assert "| adamw8bit | 17.6 GiB | 15.84 | 17.00 | 0.90 | 1.50 | 5,461 | fits |" in text


def test_rollout_speed_rows_on_cpu(tmp_path):
    """The rollout benchmark's CPU side: the tiny shape, two paths, a row each with a rate."""
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu.rollout_speed", "--shapes", "tiny", "--paths",
                           "generate,static", "--new-tokens", "4", "--out", str(tmp_path)],
                          cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=HANG_GUARD_S)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((tmp_path / "rollout_speed.json").read_text())
    assert [r["path"] for r in results] == ["generate", "static"]
    assert all(64 <= r["tokens"] <= 64 * 4 and r["tokens_per_s"] > 0 for r in results)  # a row may end early
    assert "| tiny (64 x 48+4) | static |" in (tmp_path / "rollout_speed.md").read_text()
