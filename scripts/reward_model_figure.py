"""The reward model's demo figures, measured: the tiny reward model trained from the SFT demo's
export, then PPO rewarded by it, with the rule's (true) reward logged beside the learned one.

    python scripts/reward_model_figure.py                                  # the SFT export: runs/sft/tiny_cpu/export
    python scripts/reward_model_figure.py --sft runs/sft/tiny_cpu/export --root /tmp/rm_figure
    python scripts/reward_model_figure.py --reward-model-only              # the reward model alone

1. ``configs/reward_model/tiny_cpu.yaml`` from ``--sft``: the held-out pairwise accuracy
   (``val_accuracy`` on ``data/arithmetic/preference_val.jsonl``, near misses of held-out prompts)
   at each validation, and the run's wall time;
2. ``configs/ppo/tiny_cpu_reward_model.yaml`` with ``model.reward_model`` set to that export: the
   learned reward (``reward_mean``) and the rule's (``gold_reward_mean``, exact answer, never
   trained on) over the run, as means of its first and last quarters of PPO steps, and its wall
   time.

The record goes to ``docs/reward_model_figure.json`` (``--out``) with the machine, its load average
at the start and end (a run on shared cores is slower than the same run alone), and the commands;
docs/reward_model.md states these figures.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "docs" / "reward_model_figure.json"
RM_CONFIG = "configs/reward_model/tiny_cpu.yaml"
PPO_CONFIG = "configs/ppo/tiny_cpu_reward_model.yaml"


def metrics(root: Path) -> dict[str, dict[int, float]]:
    """Every logged metric of the CSV logger under ``root``: name -> {step: value}."""
    out: dict[str, dict[int, float]] = {}
    for path in sorted(root.glob("**/metrics.csv")):
        with path.open() as f:
            for row in csv.DictReader(f):
                for name, value in row.items():
                    if name not in ("step", "epoch") and value not in ("", None):
                        out.setdefault(name, {})[int(row["step"])] = float(value)
    return out


def quarters(series: dict[int, float]) -> list[float]:
    """Means of the four quarters of ``series`` in step order."""
    values = [v for _, v in sorted(series.items())]
    q = len(values) // 4
    if q == 0:
        raise SystemExit(f"too few logged steps ({len(values)}) to split in quarters")
    return [round(sum(values[i * q:(i + 1) * q]) / q, 4) for i in range(4)]


def run(recipe: str, config: str, root: Path, *extra: str) -> tuple[list[str], float]:
    """``python -m recipes.<recipe> fit`` with the CSV logger under ``root``; its command and wall seconds."""
    command = [sys.executable, "-m", f"recipes.{recipe}", "fit", "--config", config, f"--trainer.default_root_dir={root}",
               "--trainer.logger=lightning.pytorch.loggers.CSVLogger", f"--trainer.logger.save_dir={root}",
               "--trainer.enable_progress_bar=false", *extra]
    start = time.monotonic()
    subprocess.run(command, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}, check=True)
    return ["python", *command[1:]], round(time.monotonic() - start, 1)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft", default="runs/sft/tiny_cpu/export", help="the SFT demo's export")
    parser.add_argument("--root", default="runs/reward_model_figure", help="where the two runs write")
    parser.add_argument("--out", default=str(RECORD))
    parser.add_argument("--reward-model-only", action="store_true", help="train and score the reward model, no PPO")
    args = parser.parse_args(argv)
    root = Path(args.root).resolve()
    record: dict = {"date": datetime.date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                    "load_average_start": round(os.getloadavg()[0], 1)}

    rm_root = root / "reward_model"
    command, seconds = run("reward_model", RM_CONFIG, rm_root, f"--model.name_or_path={args.sft}")
    accuracy = metrics(rm_root)["val_accuracy"]
    record["reward_model"] = {"command": " ".join(command), "wall_s": seconds,
                              "val_accuracy": {str(step + 1): round(v, 4) for step, v in sorted(accuracy.items())},
                              "final_val_accuracy": round(accuracy[max(accuracy)], 4)}
    print(f"reward model: held-out accuracy {record['reward_model']['final_val_accuracy']:.3f} in {seconds:.0f} s", flush=True)

    if not args.reward_model_only:
        ppo_root = root / "ppo"
        command, seconds = run("ppo", PPO_CONFIG, ppo_root, f"--model.name_or_path={args.sft}",
                               f"--model.reward_model.name_or_path={rm_root / 'export'}")
        logged = metrics(ppo_root)
        record["ppo"] = {"command": " ".join(command), "wall_s": seconds,
                         "reward_mean_quarters": quarters(logged["reward_mean"]),
                         "gold_reward_mean_quarters": quarters(logged["gold_reward_mean"])}
        gold = record["ppo"]["gold_reward_mean_quarters"]
        print(f"ppo: true reward {gold[0]:.3f} (first quarter) -> {gold[-1]:.3f} (last) in {seconds:.0f} s", flush=True)

    record["load_average_end"] = round(os.getloadavg()[0], 1)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    return record


if __name__ == "__main__":
    main()
