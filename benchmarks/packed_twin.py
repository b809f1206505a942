"""The tiny packed SFT config beside its padded twin: does packing learn like padding?

    OMP_NUM_THREADS=1 python benchmarks/packed_twin.py --steps 600 --out docs/img/packed_twin.png

Runs ``configs/sft/tiny_cpu.yaml`` and ``configs/sft/tiny_cpu_packed.yaml`` (one process each, the
same data, seed, schedule and token budget; each as its README command with its own root folder),
then prints both runs' validation loss at every validation step, their wall time and the tokens
their micro-batches held, and plots training and validation loss against the step. The two are
not the same batches (length-sorted padded micro-batches against random packed rows), so the
curves should agree in level and shape, not step by step.
"""

from __future__ import annotations

import argparse
import csv
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = {"padded (tiny_cpu)": "configs/sft/tiny_cpu.yaml", "packed (tiny_cpu_packed)": "configs/sft/tiny_cpu_packed.yaml"}


def fit(config: str, root: Path, steps: int) -> tuple[Path, float]:
    cmd = [sys.executable, "-m", "recipes.sft", "fit", "--config", config, "--trainer.max_steps", str(steps),
           "--trainer.default_root_dir", str(root), "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
           f"--trainer.logger.save_dir={root}", "--trainer.logger.name=logs", "--trainer.log_every_n_steps=5"]
    print("$", " ".join(cmd), flush=True)
    start = time.perf_counter()
    with open(root.with_suffix(".log"), "w") as log:
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=log, stderr=subprocess.STDOUT)
    return sorted((root / "logs").glob("version_*/metrics.csv"))[-1], time.perf_counter() - start


def series(path: Path, name: str) -> dict[int, float]:
    with open(path) as f:
        return {int(r["step"]): float(r[name]) for r in csv.DictReader(f) if r.get(name)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--out", type=Path, default=None, help="the plot (PNG); none if not given")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="packed_twin_") as tmp:
        runs = {label: fit(config, Path(tmp) / label.split()[0], args.steps) for label, config in CONFIGS.items()}
        curves = {label: (series(path, "train_loss"), series(path, "val_loss"), seconds)
                  for label, (path, seconds) in runs.items()}
        tokens = {label: sum(series(path, "train_label_tokens").values()) for label, (path, _) in runs.items()}
    for label, (_, val, seconds) in curves.items():
        print(f"{label}: val_loss " + ", ".join(f"{step}: {v:.4f}" for step, v in sorted(val.items()))
              + f"; {seconds:.0f} s; label tokens in the logged steps {tokens[label]:.0f}")
    if args.out:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for (label, (train, val, _)), colour in zip(curves.items(), ("tab:blue", "tab:orange")):
            ax.plot(sorted(train), [train[s] for s in sorted(train)], color=colour, alpha=0.45, lw=1, label=f"{label} train")
            ax.plot(sorted(val), [val[s] for s in sorted(val)], "o-", color=colour, label=f"{label} val")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("loss (token mean)")
        ax.set_yscale("log")
        ax.set_title("Tiny SFT: packed rows vs length-sorted padded batches")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.out, dpi=110)
        print(f"plot: {args.out}")


if __name__ == "__main__":
    main()
