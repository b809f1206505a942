"""The tiny tensor- and context-parallel configs beside their one-process twins: the same data,
seed and global batch, so their logged curves should agree within rounding.

    OMP_NUM_THREADS=1 python benchmarks/parallel_twins.py --sft-steps 150 --grpo-steps 16 \\
        --out docs/img/parallel_twins.png

Runs, each as its README command with ``--trainer.max_steps`` and its own root folder:
``configs/sft/tiny_cpu.yaml`` (1 process) against ``tiny_cpu_tp2.yaml`` and ``tiny_cpu_cp2.yaml``
(2 gloo ranks); then ``configs/ppo/tiny_cpu_grpo.yaml`` against ``tiny_cpu_grpo_cp2.yaml``, both
starting from the first run's export (the GRPO configs' policy is the SFT demo's export). Prints
each pair's largest difference per logged step and wall time, and plots the curves on each other.
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(recipe: str, config: str, root: Path, steps: int, extra: list[str]) -> tuple[Path, float]:
    """One fit of ``config`` for ``steps`` optimizer steps under ``root``; its metrics.csv and wall seconds."""
    cmd = [sys.executable, "-m", f"recipes.{recipe}", "fit", "--config", config,
           "--trainer.max_steps", str(steps), "--trainer.default_root_dir", str(root), *extra]
    print("$", " ".join(cmd), flush=True)
    start = time.perf_counter()
    with open(root.with_suffix(".log"), "w") as log:
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=log, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - start
    versions = sorted((root / "logs").glob("version_*/metrics.csv"))
    print(f"  {seconds:.0f} s -> {versions[-1]}", flush=True)
    return versions[-1], seconds


def series(path: Path, name: str) -> dict[int, float]:
    with open(path) as f:
        return {int(r["step"]): float(r[name]) for r in csv.DictReader(f) if r.get(name)}


def compare(name: str, a: Path, b: Path) -> float:
    left, right = series(a, name), series(b, name)
    common = sorted(set(left) & set(right))
    if not common:
        raise RuntimeError(f"no common logged steps of {name} in {a} and {b}")
    return max(abs(left[s] - right[s]) for s in common)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft-steps", type=int, default=150)
    parser.add_argument("--grpo-steps", type=int, default=16)
    parser.add_argument("--work", default="runs/parallel_twins")
    parser.add_argument("--out", default="docs/img/parallel_twins.png")
    args = parser.parse_args(argv)
    work = (ROOT / args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)

    no_val = ["--trainer.val_check_interval", str(args.sft_steps)]  # one validation, at the end
    sft = {name: run("sft", f"configs/sft/{name}.yaml", work / name, args.sft_steps, no_val)
           for name in ("tiny_cpu", "tiny_cpu_tp2", "tiny_cpu_cp2")}
    policy = ["--model.name_or_path", str(work / "tiny_cpu" / "export")]
    grpo = {name: run("ppo", f"configs/ppo/{name}.yaml", work / name, args.grpo_steps, policy)
            for name in ("tiny_cpu_grpo", "tiny_cpu_grpo_cp2")}

    rows = []
    for name in ("tiny_cpu_tp2", "tiny_cpu_cp2"):
        rows.append((name, "train_loss", compare("train_loss", sft["tiny_cpu"][0], sft[name][0]),
                     sft["tiny_cpu"][1], sft[name][1]))
    for metric in ("reward_mean", "kl", "policy_loss"):
        rows.append(("tiny_cpu_grpo_cp2", metric, compare(metric, grpo["tiny_cpu_grpo"][0], grpo["tiny_cpu_grpo_cp2"][0]),
                     grpo["tiny_cpu_grpo"][1], grpo["tiny_cpu_grpo_cp2"][1]))
    print("| config | metric | largest difference from its twin, any logged step | twin s | config s |")
    print("|---|---|---|---|---|")
    for name, metric, diff, a, b in rows:
        print(f"| {name} | {metric} | {diff:.2e} | {a:.0f} | {b:.0f} |")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("SFT train_loss", "train_loss", sft, ("tiny_cpu", "tiny_cpu_tp2", "tiny_cpu_cp2")),
              ("GRPO reward_mean", "reward_mean", grpo, ("tiny_cpu_grpo", "tiny_cpu_grpo_cp2")),
              ("GRPO kl", "kl", grpo, ("tiny_cpu_grpo", "tiny_cpu_grpo_cp2"))]
    fig, axes = plt.subplots(1, len(panels), figsize=(13, 3.6))
    styles = [dict(color="0.2", linewidth=3.0, alpha=0.35), dict(color="C0", linewidth=1.2),
              dict(color="C3", linewidth=1.0, linestyle="--")]
    for ax, (title, metric, runs, names) in zip(axes, panels):
        for name, style in zip(names, styles):
            points = series(runs[name][0], metric)
            ax.plot(list(points), list(points.values()), label=name, **style)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("2 gloo ranks (TP 2 / CP 2) vs one process, same data, seed and global batch"
                 f" (CPU, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')})", fontsize=10)
    fig.tight_layout()
    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
