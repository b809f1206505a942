"""Wall time per step of asynchronous rollouts: ``max_staleness`` 0 against 1, and both reward curves.

    python -m recipes.sft fit --config configs/sft/tiny_cpu.yaml          # the policy: runs/sft/tiny_cpu/export
    python benchmarks/async_rollout.py --steps 24 --out runs/async_rollout.json

Runs ``configs/ppo/tiny_cpu_async.yaml`` (GRPO, 1 training process + 1 generator process, 8 prompts x 8
answers = 64 samples a step) through the recipe's CLI once per ``max_staleness``, with everything else
equal, and the trainer on one thread as the generator is (``OMP_NUM_THREADS=1``; on a 2-core machine
each side gets a core). A callback records the wall clock at the end of every iteration; the first
``--warmup`` iterations (start-up, first weight sync) are not counted. Prints the median step time of
each, their ratio, each run's reward per step and quarter means, and the load average before and
after; a Markdown row for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from lightning.pytorch import Callback

REPO = Path(__file__).resolve().parent.parent


class StepClock(Callback):
    """Appends the wall clock at the end of each training iteration to ``<default_root_dir>/step_clock.json``."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.stamps.append(time.perf_counter())
        (Path(trainer.default_root_dir) / "step_clock.json").write_text(json.dumps(self.stamps))


def run(root: Path, policy: str, staleness: int, steps: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("MASTER_PORT", None)
    # GRPO with num_mini_batches 2: two optimizer steps an iteration.
    cmd = [sys.executable, "-m", "recipes.ppo", "fit", "--config", "configs/ppo/tiny_cpu_async.yaml",
           f"--trainer.default_root_dir={root}", f"--model.name_or_path={policy}",
           f"--model.async_rollout.max_staleness={staleness}", f"--trainer.max_steps={2 * steps}",
           "--trainer.logger=lightning.pytorch.loggers.CSVLogger", f"--trainer.logger.save_dir={root}",
           "--trainer.logger.name=logs", "--trainer.callbacks+=benchmarks.async_rollout.StepClock",
           "--model.export_dir=null", "--trainer.enable_progress_bar=false", "--checkpoint.every_n_train_steps=100000"]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    stamps = json.loads((root / "step_clock.json").read_text())
    rewards: dict[int, float] = {}
    for path in sorted(root.glob("logs/*/metrics.csv")):
        with path.open() as f:
            for row in csv.DictReader(f):
                if row.get("reward_mean"):
                    rewards[int(row["step"])] = float(row["reward_mean"])
    return {"stamps": stamps, "rewards": [rewards[s] for s in sorted(rewards)], "wall_s": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", default=str(REPO / "runs" / "sft" / "tiny_cpu" / "export"))
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--root", default=str(REPO / "runs" / "bench_async_rollout"))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    load_before = os.getloadavg()
    results = {}
    for k in (0, 1):
        r = run(Path(args.root) / f"k{k}", args.policy, k, args.steps)
        gaps = [b - a for a, b in zip(r["stamps"], r["stamps"][1:])][args.warmup - 1:]
        rewards = r["rewards"]
        q = max(1, len(rewards) // 4)
        results[k] = {"median_step_s": statistics.median(gaps), "mean_step_s": statistics.fmean(gaps),
                      "steps_timed": len(gaps), "wall_s": r["wall_s"], "rewards": rewards,
                      "reward_first_quarter": statistics.fmean(rewards[:q]), "reward_last_quarter": statistics.fmean(rewards[-q:])}
    load_after = os.getloadavg()
    ratio = results[1]["median_step_s"] / results[0]["median_step_s"]
    summary = {"date": time.strftime("%Y-%m-%d"), "load_before": load_before, "load_after": load_after,
               "steps": args.steps, "warmup": args.warmup, "ratio_k1_over_k0": ratio, "runs": results}
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))
    for k, r in results.items():
        print(f"max_staleness {k}: median {r['median_step_s']:.2f} s/step (mean {r['mean_step_s']:.2f}, {r['steps_timed']} steps),"
              f" reward first/last quarter {r['reward_first_quarter']:.3f} / {r['reward_last_quarter']:.3f}")
        print("  rewards:", " ".join(f"{x:.3f}" for x in r["rewards"]))
    print(f"ratio k1/k0 {ratio:.3f}; load average before {load_before[0]:.1f}, after {load_after[0]:.1f}")


if __name__ == "__main__":
    main()
