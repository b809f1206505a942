"""The DPO demo's figure, measured: `configs/dpo/tiny_cpu.yaml` at several seeds from the SFT demo's
export, each export evaluated against the export it started from.

    python scripts/dpo_figure.py                                  # seeds 42, 7, 123; the SFT export made first
    python scripts/dpo_figure.py --sft-export runs/sft/tiny_cpu/export --seeds 42 7 123

Each seed trains the DPO config (only ``seed_everything``, ``data.seed`` and the run's folder
changed: from a fixed export with dropout off, the data order is what a seed changes) from the same
SFT export, then `scripts/eval_arithmetic.py --limit 512` scores both exports on the shipped prompts
(greedy decoding: no sampling noise). The claim of docs/dpo.md is that DPO raises the greedy
exact-answer rate by at least 5 points in every seed, each run within 10 minutes on 2 cores; this
writes the measured rates, gains and times to `docs/dpo_figure.json`, with the machine and its load:
the wall times of a shared machine say as much about the load as about the run, so each run's CPU
time is recorded too; run with ``OMP_NUM_THREADS=1`` it is the wall time one idle core would take.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "docs" / "dpo_figure.json"
CONFIG = "configs/dpo/tiny_cpu.yaml"
SFT_CONFIG = "configs/sft/tiny_cpu.yaml"
#: What the figure is made from: when one of these changes, the recorded figure is stale.
INPUTS = (CONFIG, SFT_CONFIG, "data/arithmetic/preference_train.jsonl", "data/arithmetic/preference_val.jsonl",
          "data/arithmetic/train.jsonl", "data/arithmetic/prompts.jsonl", "assets/tiny-llama/config.json")
LIMIT = 512


def fingerprint() -> str:
    """sha256 over the figure's inputs (:data:`INPUTS`)."""
    digest = hashlib.sha256()
    for name in INPUTS:
        digest.update(name.encode() + b"\0" + (ROOT / name).read_bytes())
    return digest.hexdigest()


def _env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


def greedy_exact(export: Path) -> float:
    out = subprocess.run([sys.executable, "scripts/eval_arithmetic.py", str(export), "--limit", str(LIMIT)], cwd=ROOT,
                         env=_env(), check=True, capture_output=True, text=True).stdout
    return float(json.loads(out.strip().splitlines()[-1])["greedy_exact"])


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def train(recipe: str, config: str, root: Path, *extra: str) -> tuple[float, float]:
    """Run ``recipe`` on ``config`` under ``root``: its wall time and its CPU time in seconds. With
    one thread (``OMP_NUM_THREADS=1``) the CPU time is what the wall time would be on an idle core,
    whatever else the machine runs."""
    start, cpu = time.perf_counter(), _children_cpu()
    subprocess.run([sys.executable, "-m", f"recipes.{recipe}", "fit", "--config", config,
                    f"--trainer.default_root_dir={root}", f"--model.export_dir={root / 'export'}",
                    "--trainer.enable_progress_bar=false", *extra], cwd=ROOT, env=_env(), check=True)
    return time.perf_counter() - start, _children_cpu() - cpu


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 7, 123])
    parser.add_argument("--sft-export", help="the SFT demo's export to start from (default: train it first)")
    parser.add_argument("--out", default=str(RECORD))
    args = parser.parse_args(argv)
    record: dict = {"dpo_greedy_exact": {}, "gain_points": {}, "dpo_seconds": {}, "dpo_cpu_seconds": {}}
    load_at_start = round(os.getloadavg()[1], 1)  # 5-minute average: what the wall times ran under
    with tempfile.TemporaryDirectory() as tmp:
        sft_export = Path(args.sft_export) if args.sft_export else None
        if sft_export is None:
            record["sft_seconds"] = round(train("sft", SFT_CONFIG, Path(tmp) / "sft")[0], 1)
            sft_export = Path(tmp) / "sft" / "export"
        record["sft_greedy_exact"] = before = greedy_exact(sft_export)
        print(f"SFT export: greedy_exact {before:.3f}", flush=True)
        for seed in args.seeds:
            root = Path(tmp) / f"dpo{seed}"
            # data.seed too: from a fixed export with dropout off, only the data order is random.
            seconds, cpu = train("dpo", CONFIG, root, f"--seed_everything={seed}", f"--data.seed={seed}",
                                 f"--model.name_or_path={sft_export}")
            after = greedy_exact(root / "export")
            record["dpo_greedy_exact"][str(seed)] = after
            record["gain_points"][str(seed)] = round(100 * (after - before), 1)
            record["dpo_seconds"][str(seed)] = round(seconds, 1)
            record["dpo_cpu_seconds"][str(seed)] = round(cpu, 1)
            print(f"seed {seed}: greedy_exact {after:.3f} ({100 * (after - before):+.1f} points) in {seconds:.0f} s"
                  f" ({cpu:.0f} s of CPU)", flush=True)
    record.update({
        "min_gain_points": min(record["gain_points"].values()), "max_dpo_seconds": max(record["dpo_seconds"].values()),
        "max_dpo_cpu_seconds": max(record["dpo_cpu_seconds"].values()), "threads": os.environ.get("OMP_NUM_THREADS"),
        "prompts": LIMIT, "inputs": fingerprint(), "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "load_average_at_start": load_at_start, "load_average_at_end": round(os.getloadavg()[1], 1),
        "command": "python scripts/dpo_figure.py --seeds " + " ".join(map(str, args.seeds))
                   + (f" --sft-export {args.sft_export}" if args.sft_export else ""),
    })
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    return record


if __name__ == "__main__":
    main()
