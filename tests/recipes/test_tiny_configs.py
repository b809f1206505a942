"""Every tiny config, run briefly through the real CLI: no warning a user cannot act on; exports
from single-file and FSDP2-sharded checkpoints equal the run's own export.

The runs are short (2-8 steps) and shared by the tests of this file.
"""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file

import recipes.sft as sft
from tests.helpers import REPO, TINY_MODEL, run_recipe

#: Warning lines a run may print, each once: they ask for an action on this hardware.
ALLOWED = (
    # configs/qlora/tiny_cpu.yaml keeps the GPU tiers' paged optimizer; on CPU it runs unpaged and says so.
    r"model\.optimizer: PagedAdamW8bit runs without paging",
    # configs/ppo/tiny_cpu_fsdp2.yaml exercises activation offload on CPU, where it saves nothing.
    r"ActivationOffload on CPU: host and device memory are the same",
    # The FSDP2 configs offload to the host under glibc malloc: one actionable line names jemalloc.
    r"LD_PRELOAD",
)

#: What counts as a warning line: Python's and Lightning's "file.py:LINE: message" format, a
#: "...Warning:" category, or a WARNING log record.
WARNING_LINE = re.compile(r"^\S+\.py:\d+: |Warning\b|^WARNING")

SHORT = ["--trainer.val_check_interval=null", "--trainer.limit_val_batches=0", "--trainer.log_every_n_steps=1"]
SFT_SHORT = [*SHORT, "--model.lr_scheduler.init_args.warmup_steps=1", "--data.max_tokens_per_batch=256"]

RUNS: dict[str, tuple[str, list[str]]] = {
    "sft": ("sft", ["--config", "configs/sft/tiny_cpu.yaml", "--trainer.max_steps=2",
                    "--checkpoint.every_n_train_steps=2", *SFT_SHORT]),
    "sft_resumed": ("sft", ["--config", "configs/sft/tiny_cpu.yaml", "--trainer.max_steps=4", "--ckpt_path=last",
                            "--checkpoint.every_n_train_steps=2", *SFT_SHORT]),
    "sft_fsdp2": ("sft", ["--config", "configs/sft/tiny_cpu_fsdp2.yaml", "--trainer.max_steps=2",
                          "--checkpoint.every_n_train_steps=2", *SFT_SHORT]),
    "sft_packed": ("sft", ["--config", "configs/sft/tiny_cpu_packed.yaml", "--trainer.max_steps=2", *SFT_SHORT]),
    "qlora": ("qlora", ["--config", "configs/qlora/tiny_cpu.yaml", "--trainer.max_steps=2", *SFT_SHORT]),
    "reward_model": ("reward_model", ["--config", "configs/reward_model/tiny_cpu.yaml", "--trainer.max_steps=2",
                                      f"--model.name_or_path={TINY_MODEL}", "--checkpoint.every_n_train_steps=2",
                                      *SFT_SHORT]),
    "reward_model_lora": ("reward_model", ["--config", "configs/reward_model/tiny_cpu.yaml", "--trainer.max_steps=2",
                                           f"--model.name_or_path={TINY_MODEL}", "--model.lora.r=4",
                                           "--checkpoint.every_n_train_steps=2", *SFT_SHORT]),
    "ppo": ("ppo", ["--config", "configs/ppo/tiny_cpu.yaml", "--trainer.max_steps=8", f"--model.name_or_path={TINY_MODEL}",
                    "--data.batch_size=8", *SHORT]),
    "ppo_fsdp2": ("ppo", ["--config", "configs/ppo/tiny_cpu_fsdp2.yaml", "--trainer.max_steps=8",
                          f"--model.name_or_path={TINY_MODEL}", "--data.batch_size=8", *SHORT]),
    # One GRPO iteration each (2 mini-batches), 2 prompts x 8 answers: the objectives' keys from YAML.
    "ppo_dapo": ("ppo", ["--config", "configs/ppo/tiny_cpu_dapo.yaml", "--trainer.max_steps=2",
                         f"--model.name_or_path={TINY_MODEL}", "--data.batch_size=2", *SHORT]),
    "ppo_gspo": ("ppo", ["--config", "configs/ppo/tiny_cpu_gspo.yaml", "--trainer.max_steps=2",
                         f"--model.name_or_path={TINY_MODEL}", "--data.batch_size=2", *SHORT]),
    "ppo_clip_cov": ("ppo", ["--config", "configs/ppo/tiny_cpu_clip_cov.yaml", "--trainer.max_steps=2",
                             f"--model.name_or_path={TINY_MODEL}", "--data.batch_size=2", *SHORT]),
    "ppo_geo_mean": ("ppo", ["--config", "configs/ppo/tiny_cpu_geo_mean.yaml", "--trainer.max_steps=2",
                             f"--model.name_or_path={TINY_MODEL}", "--data.batch_size=2", *SHORT]),
    "dpo": ("dpo", ["--config", "configs/dpo/tiny_cpu.yaml", "--trainer.max_steps=2", f"--model.name_or_path={TINY_MODEL}",
                    "--checkpoint.every_n_train_steps=2", "--data.max_tokens_per_batch=256",
                    "--model.lr_scheduler.init_args.warmup_steps=1", *SHORT]),
}  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tiny")
    done = {}
    for name, (recipe, args) in RUNS.items():
        folder = root / name.removesuffix("_resumed")
        result = run_recipe(recipe, "fit", *args, f"--trainer.default_root_dir={folder}")
        assert result.returncode == 0, f"{name}:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
        done[name] = (folder, result.stdout + result.stderr)
    return done


def _warning_lines(output: str) -> list[str]:
    # Progress bars redraw with carriage returns; a warning always starts a line of its own.
    lines = [part for line in output.splitlines() for part in line.split("\r")]
    return [line.strip() for line in lines if WARNING_LINE.search(line)]


@pytest.mark.parametrize("name", list(RUNS))
def test_run_prints_no_warning_outside_the_allow_list(runs, name):
    _, output = runs[name]
    lines = _warning_lines(output)
    unexpected = [line for line in lines if not any(re.search(allowed, line) for allowed in ALLOWED)]
    assert unexpected == [], "\n".join(unexpected)
    assert len(lines) == len(set(lines)), f"printed twice: {lines}"


def test_progress_bar_counts_steps_of_the_run(runs):
    _, output = runs["sft_resumed"]
    # Rich's bar (Lightning's default when rich is installed) or tqdm's: "Epoch 1, step ... 4/4".
    assert re.search(r"Epoch \d+, step\b.*\b4/4\b", output), output[-2000:]
    assert not re.search(r"Epoch \d+/-\d", output)


def _same_weights(a, b):
    left, right = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert left.keys() == right.keys()
    for key in left:
        assert torch.equal(left[key], right[key]), key


def test_export_from_a_single_file_checkpoint_equals_the_runs_export(runs, tmp_path):
    folder, _ = runs["sft_resumed"]  # its last.ckpt and its export are both at step 4
    out = sft.main(["export", "--config", str(REPO / "configs/sft/tiny_cpu.yaml"), f"--trainer.default_root_dir={folder}",
                    "--ckpt_path", str(folder / "checkpoints" / "last.ckpt"), "--out", str(tmp_path / "out")])
    _same_weights(out, folder / "export")
    assert (out / "tokenizer_config.json").is_file()


def test_export_from_an_fsdp2_sharded_checkpoint_equals_the_runs_export(runs, tmp_path):
    folder, _ = runs["sft_fsdp2"]
    checkpoint = folder / "checkpoints" / "last.ckpt"
    assert checkpoint.is_symlink() and len(list(checkpoint.glob("*.distcp"))) == 2  # one shard per rank
    out = sft.main(["export", "--config", str(REPO / "configs/sft/tiny_cpu_fsdp2.yaml"),
                    f"--trainer.default_root_dir={folder}", f"--ckpt_path={checkpoint}", f"--out={tmp_path / 'out'}"])
    _same_weights(out, folder / "export")


@pytest.mark.parametrize(
    ("name", "weights", "extra"),
    [("qlora", "adapter_model.safetensors", []), ("ppo", "model.safetensors", [f"--model.name_or_path={TINY_MODEL}"]),
     ("dpo", "model.safetensors", [f"--model.name_or_path={TINY_MODEL}"]),
     ("reward_model", "model.safetensors", [f"--model.name_or_path={TINY_MODEL}"]),
     # the adapters and head from the checkpoint, merged into the run's saved random base
     ("reward_model_lora", "model.safetensors", [f"--model.name_or_path={TINY_MODEL}", "--model.lora.r=4"])],
)
def test_export_from_checkpoint_of_other_recipes_equals_the_runs_export(runs, tmp_path, name, weights, extra):
    import importlib

    folder, _ = runs[name]
    recipe, args = RUNS[name]
    config = args[args.index("--config") + 1]
    out = importlib.import_module(f"recipes.{recipe}").main([
        "export", "--config", str(REPO / config), f"--trainer.default_root_dir={folder}", *extra,
        f"--ckpt_path={folder / 'checkpoints' / 'last.ckpt'}", f"--out={tmp_path / 'out'}",
    ])  # fmt: skip
    left, right = load_file(out / weights), load_file(folder / "export" / weights)
    assert left.keys() == right.keys() and all(torch.equal(left[k], right[k]) for k in left)


def test_export_needs_a_checkpoint_path():
    with pytest.raises(SystemExit, match="--ckpt_path is required"):
        sft.main(["export", "--config", str(REPO / "configs/sft/tiny_cpu.yaml")])
