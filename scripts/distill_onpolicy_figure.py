"""Does on-policy distillation teach the tiny student more than SFT alone in the same steps? Per seed, each export scored.

    python scripts/distill_onpolicy_figure.py                       # seeds 0, 1 and 2
    python scripts/distill_onpolicy_figure.py --seeds 0 --warmup-steps 100 --steps 200

For each seed, the student (assets/tiny-llama-student) is trained three ways, each export scored by
`scripts/eval_arithmetic.py` (greedy exact answers on the shipped prompts):

1. **warm-up**: SFT (``configs/sft/tiny_cpu.yaml`` with the student) for ``--warmup-steps``: a
   random student's samples are noise the teacher cannot correct token by token, so on-policy
   distillation starts, as in practice, from a briefly SFT-trained student;
2. **SFT alone**: the same SFT for ``--warmup-steps + --steps`` steps (one run, its schedule
   spanning them all);
3. **distilled**: the warm-up's export, then ``configs/ppo/tiny_cpu_distill.yaml`` for ``--steps``
   optimizer steps (one per iteration) with the SFT demo's export as the teacher.

The teacher is ``--teacher`` (trained first when that folder does not exist:
``configs/sft/tiny_cpu.yaml``, about 2 minutes on 2 idle cores). Anything else on the command line
is an override of the distillation run. The record (rates, the command, the date and machine) goes
to ``--out``; docs/distillation.md states it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SFT_CONFIG = "configs/sft/tiny_cpu.yaml"
DISTILL_CONFIG = "configs/ppo/tiny_cpu_distill.yaml"
STUDENT = "assets/tiny-llama-student"
RECORD = ROOT / "docs" / "distill_onpolicy_figure.json"
QUIET = ["--trainer.enable_progress_bar=false", "--trainer.logger=false", "--trainer.callbacks=[]"]


def _env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


def _run(recipe: str, *args: str) -> None:
    subprocess.run([sys.executable, "-m", f"recipes.{recipe}", "fit", *args], cwd=ROOT, env=_env(), check=True)


def greedy_exact(export: Path) -> float:
    out = subprocess.run([sys.executable, "scripts/eval_arithmetic.py", str(export)], cwd=ROOT, env=_env(),
                         check=True, capture_output=True, text=True).stdout
    return float(json.loads(out.strip().splitlines()[-1])["greedy_exact"])


def sft(root: Path, *, seed: int, steps: int, model: str = STUDENT) -> Path:
    """SFT of ``model`` for ``steps`` steps at ``seed``; its export."""
    _run("sft", "--config", SFT_CONFIG, f"--seed_everything={seed}", f"--model.name_or_path={model}",
         f"--trainer.max_steps={steps}", f"--trainer.default_root_dir={root}", f"--model.export_dir={root / 'export'}",
         "--trainer.val_check_interval=null", "--trainer.limit_val_batches=0",
         f"--checkpoint.every_n_train_steps={steps}", *QUIET)
    return root / "export"


def distill(root: Path, student: Path, teacher: Path, *, seed: int, steps: int, extra: list[str]) -> Path:
    _run("ppo", "--config", DISTILL_CONFIG, f"--seed_everything={seed}", f"--model.name_or_path={student}",
         f"--model.teacher.name_or_path={teacher}", f"--trainer.max_steps={steps}", f"--trainer.default_root_dir={root}",
         f"--model.export_dir={root / 'export'}", f"--checkpoint.every_n_train_steps={steps}", *QUIET, *extra)
    return root / "export"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--warmup-steps", type=int, default=100)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--teacher", default="runs/sft/tiny_cpu/export")
    parser.add_argument("--out", default=str(RECORD))
    args, overrides = parser.parse_known_args(argv)
    teacher = (ROOT / args.teacher).resolve()
    if not (teacher / "config.json").is_file():
        sft(teacher.parent, seed=42, steps=600, model="assets/tiny-llama")
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            work = Path(tmp) / str(seed)
            warm = sft(work / "warmup", seed=seed, steps=args.warmup_steps)
            alone = sft(work / "sft", seed=seed, steps=args.warmup_steps + args.steps)
            distilled = distill(work / "distill", warm, teacher, seed=seed, steps=args.steps, extra=overrides)
            rows[str(seed)] = {name: greedy_exact(path) for name, path in
                               (("warmup", warm), ("sft", alone), ("distill", distilled))}
            print(f"seed {seed}: greedy_exact {rows[str(seed)]}", flush=True)
    record = {
        "greedy_exact": rows, "teacher_greedy_exact": greedy_exact(teacher),
        "warmup_steps": args.warmup_steps, "steps": args.steps,
        "distill_wins_every_seed": all(r["distill"] > r["sft"] for r in rows.values()),
        "date": datetime.date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "command": " ".join(["python scripts/distill_onpolicy_figure.py", "--seeds", *map(str, args.seeds),
                             f"--warmup-steps {args.warmup_steps} --steps {args.steps}", *overrides]),
    }
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record))
    return record


if __name__ == "__main__":
    main()
