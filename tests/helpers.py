"""Shared test utilities: run a recipe's CLI in a subprocess and read back what it logged."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TINY_MODEL = REPO / "assets" / "tiny-llama"
ARITH = REPO / "data" / "arithmetic"

#: Every subprocess timeout in the tests is a hang guard, not a speed check: a run that takes ten
#: times its usual time on a loaded 2-core machine must still pass (the PPO warm-up fixture once
#: hit a 600 s bound with several jobs running). One hour stops only a real hang.
HANG_GUARD_S = 3600.0


def run_recipe(recipe: str, *args: str, timeout: float = HANG_GUARD_S, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m recipes.<recipe> <args>`` from the repo root; returns the finished process."""
    # A fresh rendezvous for every run: Lightning picks a free port when MASTER_PORT is unset.
    inherited = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "PL_GLOBAL_SEED")}
    full_env = {**inherited, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", f"recipes.{recipe}", *args],
        cwd=REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def csv_logger_args(root: Path) -> list[str]:
    """Log to <root>/logs/version_N/metrics.csv (a new version per run, so a resume keeps the first part)."""
    return [
        "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
        f"--trainer.logger.save_dir={root}",
        "--trainer.logger.name=logs",
    ]


def read_metric(root: Path, name: str) -> dict[int, float]:
    """``{step: value}`` of one metric from the CSVLogger files under ``root``."""
    values: dict[int, float] = {}
    for path in sorted(root.glob("logs/*/metrics.csv")):
        with path.open() as f:
            for row in csv.DictReader(f):
                if row.get(name):
                    values[int(row["step"])] = float(row[name])
    return values


#: Token ids of the tiny tokenizer that a model trained by a short adapter fit is scored on, to
#: compare the trained model with its export, reload or merge.
PROBE_IDS = [[3, 40, 41, 42, 17, 18, 60, 61], [5, 6, 7, 8, 9, 10, 11, 12]]


def short_fit_args(config: str, root: Path, steps: int, *extra: str) -> list[str]:
    """``fit`` arguments for a short run of a tiny config: ``steps`` optimizer steps, validation and a
    checkpoint halfway and at the end, 256-token batches, metrics to CSV under ``root``."""
    return [
        "fit", "--config", config, f"--trainer.default_root_dir={root}", "--trainer.log_every_n_steps=1",
        "--trainer.enable_progress_bar=false", f"--trainer.max_steps={steps}",
        f"--trainer.val_check_interval={steps // 2}", f"--checkpoint.every_n_train_steps={steps // 2}",
        "--data.max_tokens_per_batch=256", *csv_logger_args(root), *extra,
    ]  # fmt: skip


def fit_and_probe(main, args: list[str]):  # noqa: ANN001
    """Run a recipe's ``main(args)`` in this process; its CLI and the trained model's logits on PROBE_IDS."""
    import torch

    cli = main(args)
    model = cli.model.model.eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(PROBE_IDS)).logits
    return cli, logits


def bf16_checkpoint_folder(dest: Path, source: Path = TINY_MODEL) -> Path:
    """A copy of the config-only model folder ``source`` whose config.json says
    ``torch_dtype: bfloat16``, as every real checkpoint's does (the tiny model's says nothing)."""
    import json
    import shutil

    shutil.copytree(source, dest)
    config = json.loads((dest / "config.json").read_text())
    config["torch_dtype"] = "bfloat16"
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return dest
