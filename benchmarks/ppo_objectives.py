"""GRPO, DAPO and GSPO on the arithmetic task: the reward of each tiny config's run, side by side.

    python -m recipes.sft fit --config configs/sft/tiny_cpu.yaml                 # the shared start
    for c in grpo dapo gspo; do
      python -m recipes.ppo fit --config configs/ppo/tiny_cpu_$c.yaml \\
        --trainer.logger=lightning.pytorch.loggers.CSVLogger \\
        --trainer.logger.save_dir=runs/ppo/tiny_cpu_$c --trainer.logger.name=logs
    done
    python benchmarks/ppo_objectives.py --out docs/img/ppo_tiny_cpu_objectives.png

Reads each run's ``metrics.csv`` and prints, per run, the mean *task* reward (the exact-answer
score; DAPO's overlong penalty, logged as ``overlong_penalty``, is taken back out so the three are
comparable) over each quarter of the steps, and the run's wall time from its phase times; draws
the 16-step moving averages in one panel.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.plot_metrics import moving_average, read_series  # noqa: E402

RUNS = ("grpo", "dapo", "gspo")


def task_reward(metrics: Path) -> tuple[list[int], list[float]]:
    steps, reward = read_series(metrics, "reward_mean")
    try:
        penalty_steps, penalty = read_series(metrics, "overlong_penalty")
    except KeyError:
        return steps, reward
    by_step = dict(zip(penalty_steps, penalty))
    return steps, [r - by_step.get(s, 0.0) for s, r in zip(steps, reward)]


def summary(metrics: Path) -> dict:
    steps, reward = task_reward(metrics)
    q = len(reward) // 4
    quarters = [sum(reward[i * q:(i + 1) * q]) / q for i in range(4)] if q else []
    seconds = sum(sum(read_series(metrics, f"time_{phase}_s")[1]) for phase in ("rollout", "score", "train"))
    out = {"steps": len(steps), "quarters": [round(x, 3) for x in quarters], "phase_seconds": round(seconds, 1)}
    for name in ("clipfrac_low", "clipfrac_high", "groups_filtered_frac", "truncated_frac"):
        try:
            values = read_series(metrics, name)[1]
        except KeyError:
            continue
        out[f"mean_{name}"] = round(sum(values) / len(values), 4)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default="runs/ppo", help="folder holding tiny_cpu_<name>/logs/version_*/metrics.csv")
    parser.add_argument("--out", help="PNG of the 16-step moving average of the task reward")
    parser.add_argument("--window", type=int, default=16)
    args = parser.parse_args(argv)
    found = {}
    for name in RUNS:
        files = sorted(Path(args.runs).glob(f"tiny_cpu_{name}/logs/version_*/metrics.csv"))
        if files:
            found[name] = files[-1]
    results = {name: summary(path) for name, path in found.items()}
    print(json.dumps(results, indent=1))
    if args.out:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.4))
        for i, (name, path) in enumerate(found.items()):
            steps, reward = task_reward(path)
            ax.plot(steps, reward, color=f"C{i}", alpha=0.2, linewidth=0.7)
            ax.plot(steps, moving_average(reward, args.window), color=f"C{i}", linewidth=1.8,
                    label=f"{name} (mean of {args.window})")
        ax.set_xlabel("step (8 prompts x 8 answers)")
        ax.set_ylabel("exact-answer reward")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
        ax.set_title("tiny Llama on the arithmetic prompts, from the same SFT export")
        fig.tight_layout()
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.out, dpi=110)
        print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    main()
