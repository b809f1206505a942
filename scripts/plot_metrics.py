"""Plot logged metrics of a run over steps, one panel each, with a moving average.

    python scripts/plot_metrics.py runs/ppo/tiny_cpu/logs/version_0/metrics.csv \\
        reward_mean kl entropy --out ppo_tiny.png

Reads the CSVLogger's ``metrics.csv``; rows without a value for a metric are skipped.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path


def read_series(path: str | Path, name: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    with open(path) as f:
        reader = csv.DictReader(f)
        if name not in (reader.fieldnames or []):
            raise KeyError(f"{path}: no column `{name}` (columns: {', '.join(reader.fieldnames or [])})")
        for row in reader:
            if row.get(name):
                steps.append(int(row["step"]))
                values.append(float(row[name]))
    return steps, values


def moving_average(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot(path: str | Path, names: list[str], out: str | Path, window: int = 16, title: str | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = {name: read_series(path, name) for name in names}  # every name checked before drawing
    fig, axes = plt.subplots(len(names), 1, figsize=(7, 2.4 * len(names)), sharex=True, squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        steps, values = series[name]
        ax.plot(steps, values, color="0.75", linewidth=0.8, label="per step")
        ax.plot(steps, moving_average(values, window), color="C0", linewidth=1.8, label=f"mean of {window}")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    axes[0, 0].legend(loc="best", fontsize=8)
    axes[-1, 0].set_xlabel("step")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("metrics", help="a CSVLogger metrics.csv")
    parser.add_argument("names", nargs="+", help="columns to plot")
    parser.add_argument("--out", required=True)
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--title")
    args = parser.parse_args(argv)
    out = plot(args.metrics, args.names, args.out, window=args.window, title=args.title)
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
