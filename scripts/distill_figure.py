"""Does logit distillation teach the tiny student more than SFT alone? Both runs per seed, each export scored.

    python scripts/distill_figure.py                                  # seeds 42, 7 and 123
    python scripts/distill_figure.py --teacher runs/sft/tiny_cpu/export --seeds 42 --trainer.max_steps=200

For each seed, the student (assets/tiny-llama-student) trains ``configs/sft/tiny_cpu_distill.yaml``
twice, for the same steps on the same data order: once as shipped (forward KL from the teacher,
mixed half and half with the cross-entropy), once with ``model.distillation`` off (SFT alone).
`scripts/eval_arithmetic.py` scores each export's greedy exact-answer rate on the shipped prompts
(and the teacher's once). The teacher is the SFT demo's export (``--teacher``); when that folder
does not exist it is trained first (``configs/sft/tiny_cpu.yaml``, about 2 minutes on 2 idle cores).
The record (rates, the command, the date and machine, a fingerprint of the runs' inputs) goes to
``--out``; docs/distillation.md states it, and tests/test_scripts.py checks the two agree and that
the record is of the current inputs (rerun this after changing them).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/sft/tiny_cpu_distill.yaml"
RECORD = ROOT / "docs" / "distill_figure.json"
#: What the runs train on and from: when one of these changes, the recorded figure is stale.
INPUTS = (CONFIG, "configs/sft/tiny_cpu.yaml", "data/arithmetic/train.jsonl", "data/arithmetic/val.jsonl",
          "data/arithmetic/prompts.jsonl", "assets/tiny-llama/config.json", "assets/tiny-llama-student/config.json")


def fingerprint(inputs: tuple[str, ...] = INPUTS) -> str:
    """sha256 over the runs' inputs (:data:`INPUTS`, or another script's)."""
    digest = hashlib.sha256()
    for name in inputs:
        digest.update(name.encode() + b"\0" + (ROOT / name).read_bytes())
    return digest.hexdigest()


def _env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


def greedy_exact(export: Path) -> float:
    out = subprocess.run([sys.executable, "scripts/eval_arithmetic.py", str(export)], cwd=ROOT, env=_env(),
                         check=True, capture_output=True, text=True).stdout
    return float(json.loads(out.strip().splitlines()[-1])["greedy_exact"])


def ready_teacher(folder: str) -> Path:
    """The teacher's folder (relative to the repository), trained first when it holds no model."""
    teacher = (ROOT / folder).resolve()
    if not (teacher / "config.json").is_file():
        train_teacher(teacher)
    return teacher


def train_teacher(teacher: Path) -> None:
    root = teacher.parent
    subprocess.run([sys.executable, "-m", "recipes.sft", "fit", "--config", "configs/sft/tiny_cpu.yaml",
                    f"--trainer.default_root_dir={root}", f"--model.export_dir={teacher}",
                    "--trainer.enable_progress_bar=false"], cwd=ROOT, env=_env(), check=True)


def run_student(seed: int, root: Path, teacher: Path, *, distill: bool, extra: list[str]) -> float:
    """Train the student at ``seed`` under ``root`` (with the teacher or without) and score its export."""
    args = [sys.executable, "-m", "recipes.sft", "fit", "--config", CONFIG, f"--seed_everything={seed}",
            f"--trainer.default_root_dir={root}", f"--model.export_dir={root / 'export'}",
            "--trainer.enable_progress_bar=false", "--trainer.logger=false", "--trainer.callbacks=[]"]
    args.append(f"--model.distillation.teacher.name_or_path={teacher}" if distill else "--model.distillation=null")
    subprocess.run([*args, *extra], cwd=ROOT, env=_env(), check=True)
    return greedy_exact(root / "export")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 7, 123])
    parser.add_argument("--teacher", default="runs/sft/tiny_cpu/export")
    parser.add_argument("--out", default=str(RECORD))
    # Anything else is a recipe override for both runs (e.g. --trainer.max_steps=200).
    args, overrides = parser.parse_known_args(argv)
    teacher = ready_teacher(args.teacher)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            sft = run_student(seed, Path(tmp) / f"sft{seed}", teacher, distill=False, extra=overrides)
            kd = run_student(seed, Path(tmp) / f"kd{seed}", teacher, distill=True, extra=overrides)
            rows[str(seed)] = {"sft": sft, "distill": kd}
            print(f"seed {seed}: greedy_exact SFT alone {sft:.3f}, distilled {kd:.3f}", flush=True)
    record = {
        "greedy_exact": rows, "teacher_greedy_exact": greedy_exact(teacher),
        "distill_wins_every_seed": all(r["distill"] > r["sft"] for r in rows.values()), "inputs": fingerprint(),
        "date": datetime.date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "command": " ".join(["python scripts/distill_figure.py", "--seeds", *map(str, args.seeds), *overrides]),
    }
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record))
    return record


if __name__ == "__main__":
    main()
