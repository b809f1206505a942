"""The reward model's demo figures, measured: tiny reward models trained from the SFT demo's export,
then PPO rewarded by their ensemble, with the rule's (true) reward logged beside the learned one.

    python scripts/reward_model_figure.py                        # the SFT export: runs/sft/tiny_cpu/export
    python scripts/reward_model_figure.py --jobs 2               # two reward models side by side
    python scripts/reward_model_figure.py --reward-model-only

1. ``configs/reward_model/tiny_cpu.yaml`` from ``--sft`` once per member of :data:`MEMBERS`: the
   shipped pairs (``reward_train.jsonl``: near and wide misses) alone, and with the SFT policy's own
   wrong answers as rejected sides (``scripts/make_policy_pairs.py``, three mixes): each run's
   held-out pairwise accuracy (``val_accuracy`` on ``data/arithmetic/preference_val.jsonl``, near
   misses of held-out prompts) at each validation, and its wall time; then the same 400 held-out
   pairs scored by every export and by the ensemble's mean score. A member whose export is already
   under ``--root`` is read, not retrained (``"reused": true`` in the record);
2. ``configs/ppo/tiny_cpu_reward_model.yaml`` with ``model.reward_model.name_or_path`` the list of
   those exports: the learned reward (``reward_mean``) and the rule's (``gold_reward_mean``, exact
   answer, never trained on) over the run, as means of its first and last quarters of PPO steps,
   and its wall time; then ``scripts/eval_arithmetic.py``'s probability of the exact answer
   (no sampling noise) of the SFT export and of PPO's.

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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere, no install needed

RECORD = ROOT / "docs" / "reward_model_figure.json"
RM_CONFIG = "configs/reward_model/tiny_cpu.yaml"
PPO_CONFIG = "configs/ppo/tiny_cpu_reward_model.yaml"
VAL_PAIRS = ROOT / "data" / "arithmetic" / "preference_val.jsonl"

#: The ensemble: a member's name and ``scripts/make_policy_pairs.py``'s arguments for its training
#: pairs (None: the config's own ``reward_train.jsonl``). Reward models trained on different pairs
#: err on different prompts; their mean ranks the right answer first far more often than any one
#: (docs/reward_model.md).
MEMBERS = {
    "shipped": None,
    "policy8x1": ["--samples", "8", "--per-prompt", "4", "--repeat", "1"],
    "policy8x3": ["--samples", "8", "--per-prompt", "4", "--repeat", "3"],
    "policy16x2": ["--samples", "16", "--per-prompt", "6", "--repeat", "2"],
}


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
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    subprocess.run(command, cwd=ROOT, env=env, check=True)
    return ["python", *command[1:]], round(time.monotonic() - start, 1)


def held_out_accuracy(exports: list[str], pairs: Path = VAL_PAIRS) -> dict[str, float]:
    """Pairwise accuracy on ``pairs`` (chosen scored above rejected; a tie counts half) of each
    export and of their mean score (``"ensemble"``): the score the PPO config trains on."""
    import torch

    from lightning_mem.data import read_rows
    from lightning_mem.data.pairs import row_to_pair
    from lightning_mem.rl.reward import load_reward_model

    prompts, chosen, rejected = [], [], []
    for row in read_rows(pairs):
        prompt, good, bad, _ = row_to_pair(row)
        prompts.append(prompt)
        chosen.append(good[-1]["content"])
        rejected.append(bad[-1]["content"])
    margins = []
    for path in exports:
        model = load_reward_model(path, dtype="float32", max_length=64)
        with torch.no_grad():
            margins.append(model(prompts, chosen) - model(prompts, rejected))
    accuracy = lambda m: round(float(((m > 0).float() + 0.5 * (m == 0).float()).mean()), 4)  # noqa: E731
    result = {path: accuracy(m) for path, m in zip(exports, margins)}
    result["ensemble"] = accuracy(torch.stack(margins).mean(0))  # the mean's margin is the margins' mean
    return result


def answer_probability(export: str) -> float:
    from scripts.eval_arithmetic import evaluate

    return round(evaluate(export, limit=512)["answer_probability"], 4)


def train_reward_models(sft: str, root: Path, jobs: int) -> dict:
    def one(name: str) -> dict:
        rm_root = root / f"reward_model_{name}"
        entry: dict = {"name": name, "export": str(rm_root / "export")}
        if (rm_root / "export").is_dir():
            entry["reused"] = True
        else:
            extra = [f"--model.name_or_path={sft}"]
            if MEMBERS[name] is not None:
                data = root / "data" / f"{name}.jsonl"
                make = [sys.executable, str(ROOT / "scripts" / "make_policy_pairs.py"), "--policy", sft, "--out", str(data),
                        *MEMBERS[name]]
                subprocess.run(make, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, check=True)
                entry["pairs"] = " ".join(["python", *make[1:]])
                extra.append(f"--data.train_file={data}")
            command, seconds = run("reward_model", RM_CONFIG, rm_root, *extra)
            entry.update(command=" ".join(command), wall_s=seconds)
        accuracy = metrics(rm_root)["val_accuracy"]
        entry["val_accuracy"] = {str(step + 1): round(v, 4) for step, v in sorted(accuracy.items())}
        print(f"reward model {name}: held-out accuracy {accuracy[max(accuracy)]:.3f}", flush=True)
        return entry

    with ThreadPoolExecutor(jobs) as pool:
        members = list(pool.map(one, MEMBERS))
    scored = held_out_accuracy([m["export"] for m in members])
    for m in members:
        m["held_out_accuracy"] = scored[m["export"]]
    return {"members": members, "ensemble_held_out_accuracy": scored["ensemble"]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft", default="runs/sft/tiny_cpu/export", help="the SFT demo's export")
    parser.add_argument("--root", default="runs/reward_model_figure", help="where the runs write")
    parser.add_argument("--jobs", type=int, default=1, help="reward models trained side by side")
    parser.add_argument("--out", default=str(RECORD))
    parser.add_argument("--reward-model-only", action="store_true", help="train and score the reward models, no PPO")
    args = parser.parse_args(argv)
    root = Path(args.root).resolve()
    record: dict = {"date": datetime.date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                    "load_average_start": round(os.getloadavg()[0], 1), "jobs": args.jobs}
    record["reward_models"] = train_reward_models(args.sft, root, args.jobs)
    print(f"ensemble of {len(MEMBERS)}: held-out accuracy {record['reward_models']['ensemble_held_out_accuracy']:.3f}",
          flush=True)

    if not args.reward_model_only:
        ppo_root = root / "ppo"
        exports = [m["export"] for m in record["reward_models"]["members"]]
        command, seconds = run("ppo", PPO_CONFIG, ppo_root, f"--model.name_or_path={args.sft}",
                               f"--model.reward_model.name_or_path={json.dumps(exports)}")
        logged = metrics(ppo_root)
        record["ppo"] = {"command": " ".join(command), "wall_s": seconds,
                         "reward_mean_quarters": quarters(logged["reward_mean"]),
                         "gold_reward_mean_quarters": quarters(logged["gold_reward_mean"]),
                         "answer_probability": {"sft": answer_probability(args.sft),
                                                "ppo": answer_probability(str(ppo_root / "export"))}}
        gold = record["ppo"]["gold_reward_mean_quarters"]
        print(f"ppo: true reward {gold[0]:.3f} (first quarter) -> {gold[-1]:.3f} (last) in {seconds:.0f} s; "
              f"P(exact answer) {record['ppo']['answer_probability']}", flush=True)

    record["load_average_end"] = round(os.getloadavg()[0], 1)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    return record


if __name__ == "__main__":
    main()
