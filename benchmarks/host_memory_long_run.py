"""Host memory over a long PPO run: after warm-up, resident memory must stay flat.

Host-RAM growth under offload is the most reported memory problem of RL frameworks (verl #429,
#630, #2950, #3453; OpenRLHF #1065): every step copies optimizer state and frozen models between
device and host, and a buffer kept by mistake, a list that grows per step, or an allocator that
never hands fragments back shows up as RSS rising step after step until the host OOMs hours in.

This runs the tiny PPO recipe (configs/ppo/tiny_cpu.yaml + benchmarks/long_run_ppo.yaml:
optimizer state and the reference on the host between phases, the memory monitor at every step)
for ``--iterations`` PPO steps in a child process, then reads the monitor's memory.csv and fits a
line to RSS over the steps after warm-up. It prints the slope (KiB per PPO step), the growth over
that window and a markdown row for docs/benchmarks.md, and writes a plot.

    nice -n 5 python benchmarks/host_memory_long_run.py --iterations 512
    python benchmarks/host_memory_long_run.py --csv runs/bench/long_run_ppo/logs/version_0/memory.csv  # re-analyse

The SFT demo's export is the policy (make it first: ``python -m recipes.sft fit --config
configs/sft/tiny_cpu.yaml``).
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = 512  # rows of data/arithmetic/prompts.jsonl


def run_recipe(iterations: int, batch_size: int, root_dir: Path, extra: list[str]) -> Path:
    """Run the PPO recipe for at least ``iterations`` PPO steps; return its memory.csv."""
    epochs = math.ceil(iterations * batch_size / PROMPTS)
    cmd = [
        sys.executable, "-m", "recipes.ppo", "fit",
        "--config", "configs/ppo/tiny_cpu.yaml", "--config", "benchmarks/long_run_ppo.yaml",
        f"--data.batch_size={batch_size}", f"--trainer.max_epochs={epochs}",
        f"--trainer.default_root_dir={root_dir}", "--trainer.enable_progress_bar=false", *extra,
    ]
    # One thread: the run shares the machine, and RSS, not speed, is the figure.
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    print("+", " ".join(cmd), flush=True)
    start = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)
    print(f"run took {time.perf_counter() - start:.0f} s", flush=True)
    logs = sorted((root_dir / "logs").glob("version_*/memory.csv"), key=lambda p: p.stat().st_mtime)
    if not logs:
        raise FileNotFoundError(f"no memory.csv under {root_dir / 'logs'}")
    return logs[-1]


def step_rss(csv_path: Path) -> list[int]:
    """Host RSS at the end of each PPO step (the monitor's ``step`` samples), in order."""
    with open(csv_path, newline="") as handle:
        return [int(float(r["host_rss_bytes"])) for r in csv.DictReader(handle) if r["event"] == "step"]


def fit_line(ys: list[float]) -> tuple[float, float]:
    """Least-squares slope and intercept of ``ys`` over their indices."""
    n = len(ys)
    mean_x, mean_y = (n - 1) / 2, sum(ys) / n
    sxx = sum((x - mean_x) ** 2 for x in range(n))
    slope = sum((x - mean_x) * (y - mean_y) for x, y in enumerate(ys)) / sxx
    return slope, mean_y - slope * mean_x


def analyse(rss: list[int], warmup: float) -> dict[str, float]:
    start = int(len(rss) * warmup)
    window = rss[start:]
    if len(window) < 10:
        raise ValueError(f"only {len(window)} steps after warm-up: run more iterations")
    slope, _ = fit_line([float(v) for v in window])
    return {
        "steps": len(rss),
        "warmup_steps": start,
        "rss_start_mib": rss[0] / 2**20,
        "rss_after_warmup_mib": window[0] / 2**20,
        "rss_end_mib": rss[-1] / 2**20,
        "rss_max_mib": max(rss) / 2**20,
        "slope_kib_per_step": slope / 1024,
        "fitted_growth_mib": slope * (len(window) - 1) / 2**20,
    }


def plot(rss: list[int], stats: dict[str, float], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.plot(range(len(rss)), [v / 2**20 for v in rss], lw=1, label="host RSS after each PPO step")
    start = int(stats["warmup_steps"])
    ax.axvspan(0, start, color="0.9", label="warm-up (not fitted)")
    window = rss[start:]
    s, b = fit_line([float(v) for v in window])
    ax.plot(range(start, len(rss)), [(b + s * i) / 2**20 for i in range(len(window))], "r--", lw=1,
            label=f"fit: {stats['slope_kib_per_step']:+.2f} KiB/step")
    ax.set_ylim(0, max(rss) / 2**20 * 1.15)
    ax.set_xlabel("PPO step")
    ax.set_ylabel("MiB")
    ax.set_title(title, fontsize=9)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=512, help="PPO steps (batches of prompts)")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per PPO step")
    parser.add_argument("--warmup", type=float, default=0.2, help="share of the steps left out of the fit")
    parser.add_argument("--root-dir", type=Path, default=ROOT / "runs/bench/long_run_ppo")
    parser.add_argument("--csv", type=Path, help="analyse this memory.csv instead of running")
    parser.add_argument("--plot", type=Path, default=ROOT / "docs/img/long_run_host_rss.png")
    parser.add_argument("--label", default="tiny PPO, optimizer state + reference on the host")
    parser.add_argument("extra", nargs="*", help="more recipe overrides (after --)")
    args = parser.parse_args(argv)
    csv_path = args.csv or run_recipe(args.iterations, args.batch_size, args.root_dir, args.extra)
    rss = step_rss(csv_path)
    stats = analyse(rss, args.warmup)
    plot(rss, stats, args.plot, f"{args.label}: {stats['steps']:.0f} steps")
    for key, value in stats.items():
        print(f"{key:24s} {value:.3f}")
    print(
        f"| {time.strftime('%Y-%m-%d')} | {args.label}, {stats['steps']:.0f} PPO steps of {args.batch_size} prompts |"
        f" `python benchmarks/host_memory_long_run.py --iterations {args.iterations}` |"
        f" RSS {stats['rss_start_mib']:.0f} MiB after step 1, {stats['rss_after_warmup_mib']:.0f} MiB after warm-up"
        f" ({stats['warmup_steps']:.0f} steps), {stats['rss_end_mib']:.0f} MiB at the end; slope after warm-up"
        f" {stats['slope_kib_per_step']:+.2f} KiB/step ({stats['fitted_growth_mib']:+.1f} MiB fitted over the window) |"
    )
    print(f"plot: {args.plot}")
    return stats


if __name__ == "__main__":
    main()
