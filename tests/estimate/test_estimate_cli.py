"""The estimator's command line, sizes, tiers and verdicts, and the FitCheck callback's plumbing."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

import pytest

from lightning_mem.callbacks.fit_check import FitCheck, config_from_argv
from lightning_mem.estimate import parse_size, tier_of, usable_bytes
from lightning_mem.estimate.__main__ import main
from lightning_mem.settings import SettingError
from tests.helpers import HANG_GUARD_S, REPO


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
    code = main(["--config", "configs/sft/tiny_cpu.yaml", "--device-memory", "1.15GiB", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 1 and out["fits"] is False  # the tiny step needs ~120 MiB, 1.15 GiB leaves ~36 MiB
    assert out["device_peak_bytes"] == max(p["device_peak_bytes"] for p in out["phases"])
    phase = out["phases"][0]
    assert set(phase["device_breakdown_bytes"]) == {
        "weights", "gradients", "optimizer_state", "activations", "logits", "kv_cache", "other"}
    assert sum(phase["device_breakdown_bytes"].values()) == phase["device_peak_bytes"]
    assert out["margin"]["fraction"] == 0.1 and out["usable_device_bytes"] == usable_bytes(int(1.15 * (1 << 30)))


def test_bad_override_fails_before_any_model(capsys):
    with pytest.raises(SystemExit):
        main(["--config", "configs/sft/tiny_cpu.yaml", "--data.max_lenght", "8"])
    err = capsys.readouterr().err  # the recipe's parser, named as the command the user ran
    assert "tip: For details of accepted options run: python -m lightning_mem.estimate --help" in err
    assert "__main__.py" not in err


def test_the_command_prints_a_bad_setting_as_one_line():
    args = ["--config", "configs/sft/qwen2.5-1.5b_1x24gb.yaml", "--model.name_or_path", "Qwen/Qwen2.5-3B"]
    done = subprocess.run([sys.executable, "-m", "lightning_mem.estimate", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=HANG_GUARD_S, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(
        "error: `model.name_or_path`: no config.json is shipped for the hub id 'Qwen/Qwen2.5-3B' (looked in "), errors


@pytest.mark.parametrize(("size", "message"), [
    ("24XB", "error: `--device-memory`: cannot read '24XB' as a size; write e.g. 24GiB, 80GB or a byte count"),
    ("1GiB", "error: `--device-memory`: 1GiB leaves nothing for the run: the estimate reserves 1.10 GiB of a device"
             " that size (10% of the device for allocator fragmentation + 1 GiB for the CUDA context); give at least"
             " 1.12 GiB"),
], ids=["unreadable", "all-reserve"])
def test_a_device_size_it_cannot_use_is_one_line_before_any_estimate(size, message, capsys, monkeypatch):
    from lightning_mem.cli import DEBUG_ENV, run_command

    monkeypatch.delenv(DEBUG_ENV, raising=False)
    with pytest.raises(SystemExit) as exit_info:  # as `python -m lightning_mem.estimate` runs main
        run_command(lambda: main(["--config", "configs/sft/tiny_cpu.yaml", "--device-memory", size]))
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [message]


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


def test_fit_check_without_a_config_names_its_argument(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train.py", "fit", "--trainer.max_steps=3"])
    with pytest.raises(SettingError, match=r"^`trainer.callbacks\[FitCheck\].init_args.config`: none given, and no"
                                           r" --config on the command line"):
        FitCheck().command(24 << 30, 1)


def test_the_estimators_own_refusals_name_the_flag_or_key(tmp_path):
    from lightning_mem.estimate.recipe_config import precision_plugin, recipe_for, recipe_parts

    with pytest.raises(SettingError, match=r"^`--recipe` is needed: cannot tell the recipe of --config"):
        recipe_for(tmp_path / "mine" / "x.yaml")
    with pytest.raises(SettingError, match=r"^`--recipe` 'recipes.no_such_recipe': no such module$"):
        recipe_parts("recipes.no_such_recipe")
    with pytest.raises(SettingError, match=r"^`--recipe` 'recipes.rewards': expected one LightningModule"):
        recipe_parts("recipes.rewards")
    with pytest.raises(SettingError, match=r"^`trainer.precision`: the estimator does not know 'transformer-engine'$"):
        precision_plugin("transformer-engine")


def test_fit_check_report_warns_with_suggestions():
    result = {
        "phases": [{"phase": "train", "device_peak_bytes": 30 << 30}], "usable_device_bytes": 20 << 30,
        "fits": False, "margin": {"what": "m"},
        "suggestions": [{"what": "smaller", "overrides": ["--a=1"], "device_peak_bytes": 10 << 30, "fits": True}],
    }
    with pytest.warns(UserWarning, match=r"(?s)train 30.0 GiB.*--a=1"):
        FitCheck().report(result)
    with pytest.warns(UserWarning, match=r"^  fits \(10.0 GiB\): smaller: --a=1$"), pytest.raises(
            SettingError, match=r"^`trainer.callbacks\[FitCheck\].init_args.fail`: true, and estimated peaks per rank train"
                                r" 30.0 GiB: more than the 20.0 GiB usable .* The run will likely run out of memory.$"):
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
    for s in fitting:  # each a ready-to-run line with its estimated cost
        assert s["command"] == " ".join(["python -m recipes.sft fit --config configs/sft/tiny_cpu.yaml", *s["overrides"]])
        assert s["cost"]["text"]
    checkpointing = next(s for s in fitting if "ActivationCheckpointing" in " ".join(s["overrides"]))
    assert checkpointing["cost"]["extra_forwards"] == 1.0 and checkpointing["cost"]["transfer_bytes_per_step"] == 0


def _estimate(train_breakdown, host=0):
    from lightning_mem.estimate import Estimate, PhaseEstimate

    phase = PhaseEstimate("train", sum(train_breakdown.values()), train_breakdown, host)
    return Estimate("c.yaml", "recipes.sft", 1, "single device", [phase])


def test_suggestion_costs_are_read_off_the_estimates():
    from lightning_mem.estimate.suggest import cost_of

    base = _estimate({"weights": 100, "gradients": 40, "optimizer_state": 800, "activations": 500}, host=10)
    offloaded = _estimate({"weights": 100, "gradients": 40, "optimizer_state": 800, "activations": 50}, host=460)
    # Activation offload: the re-estimate's extra host bytes, there and back, every micro-batch.
    assert cost_of(["activation_offload"], base, offloaded, micro_batches=4).transfer_bytes_per_step == 2 * 450 * 4
    # A PPO memory plan parks the optimizer state around the rollout: off and back, every step.
    assert cost_of(["state_on_host"], base, base, micro_batches=1).transfer_bytes_per_step == 2 * 800
    # FSDP2 CPU offload: weights in for forward and backward, gradients out, every micro-batch.
    cpu = cost_of(["cpu_offload"], base, base, micro_batches=2)
    assert cpu.transfer_bytes_per_step == (2 * 100 + 40) * 2 and "the optimizer step runs on the CPU" in cpu.changes
    both = cost_of(["split", "recompute", "recompute"], base, base, micro_batches=2)
    assert both.extra_forwards == 1.0 and both.transfer_bytes_per_step == 0  # each kind counted once
    assert both.describe().startswith("+1 forward of every block per micro-batch (about 33% more compute); "
                                      "no host<->device transfers; smaller micro-batches")


def test_suggestions_print_as_commands_with_peak_and_cost():
    from lightning_mem.estimate.report import suggestions_text

    text = suggestions_text([
        {"what": "activation checkpointing of every block", "overrides": ["--x=1"], "device_peak_bytes": 3 << 30,
         "fits": True, "cost": {"text": "+1 forward"}, "command": "python -m recipes.sft fit --config c.yaml --x=1"},
        {"what": "8-bit", "overrides": ["--y=2"], "error": "bitsandbytes is missing"},
    ])
    assert text.splitlines()[1:] == [
        "suggestions (re-estimated, cheapest first; costs per rank and optimizer step):",
        "  fits at 3.00 GiB: activation checkpointing of every block",
        "    cost: +1 forward",
        "    python -m recipes.sft fit --config c.yaml --x=1",
        "  cannot apply: 8-bit: bitsandbytes is missing",
    ]


def test_suggest_without_a_device_size_says_how_to_give_one(capsys, tmp_path):
    config = tmp_path / "sft" / "mine.yaml"
    config.parent.mkdir()
    config.write_text((REPO / "configs/sft/tiny_cpu.yaml").read_text())
    with pytest.raises(SystemExit):
        main(["--config", str(config), "--suggest"])
    assert "--suggest needs a device size to fit into: pass --device-memory" in capsys.readouterr().err


def test_the_command_imports_bitsandbytes_uncompiled():
    """The command's process imports bitsandbytes without declaring its CPU kernels compiled (which
    imports torch's inductor); its kernels still run, and torch.compile is torch's own again after."""
    code = (
        "import sys, torch\n"
        "from lightning_mem.estimate.__main__ import _BitsandbytesUncompiled\n"
        "compile_ = torch.compile\n"
        "sys.meta_path.insert(0, _BitsandbytesUncompiled())\n"
        "import bitsandbytes.functional as F\n"
        "assert torch.compile is compile_\n"
        "assert 'torch._inductor.compile_fx' not in sys.modules\n"
        "torch.manual_seed(0)\n"
        "w = torch.randn(64, 64)\n"
        "q, state = F.quantize_4bit(w, quant_type='nf4')\n"
        "err = (F.dequantize_4bit(q, state) - w).abs().reshape(-1, state.blocksize).amax(1)\n"
        "absmax = w.abs().reshape(-1, state.blocksize).amax(1)\n"
        # NF4's widest gap between neighbouring levels is 0.277 of a block's absmax, so a value
        # lands at most about 0.14 of it from its level; 0.2 leaves room for rounding near the edges
        # and still fails on a kernel that returns garbage (error of the order of absmax itself).
        "assert (err <= 0.2 * absmax).all(), (err / absmax).max().item()\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
