"""Does on-policy distillation teach the tiny student more than SFT alone in the same steps? Per seed, each export scored.

    python scripts/distill_onpolicy_figure.py                       # seeds 0, 1 and 2, one after another
    python scripts/distill_onpolicy_figure.py --jobs 3              # the seeds side by side
    python scripts/distill_onpolicy_figure.py --seeds 0 --warmup-steps 100 --steps 200

For each seed, the student (assets/tiny-llama-student) is trained three ways, each export scored by
`scripts/eval_arithmetic.py` (greedy exact answers on the first 256 shipped prompts):

1. **warm-up**: SFT (``configs/sft/tiny_cpu.yaml`` with the student) for ``--warmup-steps``: a
   random student's samples are noise the teacher cannot correct token by token, so on-policy
   distillation starts, as in practice, from a briefly SFT-trained student;
2. **SFT alone**: the same SFT for ``--warmup-steps + --steps`` steps (one run, its schedule
   spanning them all): the same student, the same number of optimizer steps;
3. **distilled**: the warm-up's export, then ``configs/ppo/tiny_cpu_distill.yaml`` for ``--steps``
   optimizer steps (one per iteration) with the SFT demo's export as the teacher: its dense
   signal (the teacher's top-16 at every sampled position, ``model.teacher.top_k``); the
   one-sample signal of the first record is ``--model.teacher.top_k=null --model.teacher.coef=1``
   with that record's ``--data.batch_size=16 --model.grpo.group_size=8``.

The teacher is ``--teacher`` (trained first when that folder does not exist:
``configs/sft/tiny_cpu.yaml``, about 2 minutes on 2 idle cores). Anything else on the command line
is an override of the distillation run. The record (rates, each run's wall time, the command, the
date and machine, a fingerprint of the runs' inputs) goes to ``--out``; docs/distillation.md
states it and tests/test_scripts.py checks that the two agree and that the record is of the current
inputs (rerun this after changing them).
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
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.distill_figure import _env, fingerprint, greedy_exact, ready_teacher  # noqa: E402

SFT_CONFIG = "configs/sft/tiny_cpu.yaml"
DISTILL_CONFIG = "configs/ppo/tiny_cpu_distill.yaml"
STUDENT = "assets/tiny-llama-student"
RECORD = ROOT / "docs" / "distill_onpolicy_figure.json"
#: What the runs train on and from: when one of these changes, the recorded figure is stale.
INPUTS = (DISTILL_CONFIG, SFT_CONFIG, "data/arithmetic/train.jsonl", "data/arithmetic/prompts.jsonl",
          "assets/tiny-llama/config.json", f"{STUDENT}/config.json")
QUIET = ["--trainer.enable_progress_bar=false", "--trainer.logger=false", "--trainer.callbacks=[]"]


def _run(recipe: str, *args: str) -> float:
    """One recipe run; its wall time in seconds."""
    start = time.monotonic()
    subprocess.run([sys.executable, "-m", f"recipes.{recipe}", "fit", *args], cwd=ROOT, env=_env(), check=True,
                   stdout=subprocess.DEVNULL)
    return time.monotonic() - start


def sft(root: Path, *, seed: int, steps: int) -> tuple[Path, float]:
    """SFT of the student for ``steps`` steps at ``seed``: its export and the run's seconds."""
    seconds = _run("sft", "--config", SFT_CONFIG, f"--seed_everything={seed}", f"--model.name_or_path={STUDENT}",
                   f"--trainer.max_steps={steps}", f"--trainer.default_root_dir={root}",
                   f"--model.export_dir={root / 'export'}", "--trainer.val_check_interval=null",
                   "--trainer.limit_val_batches=0", f"--checkpoint.every_n_train_steps={steps}", *QUIET)
    return root / "export", seconds


def distill(root: Path, student: Path, teacher: Path, *, seed: int, steps: int, extra: list[str]) -> tuple[Path, float]:
    seconds = _run("ppo", "--config", DISTILL_CONFIG, f"--seed_everything={seed}", f"--model.name_or_path={student}",
                   f"--model.teacher.name_or_path={teacher}", f"--trainer.max_steps={steps}",
                   f"--trainer.default_root_dir={root}", f"--model.export_dir={root / 'export'}",
                   f"--checkpoint.every_n_train_steps={steps}", *QUIET, *extra)
    return root / "export", seconds


def one_seed(work: Path, seed: int, teacher: Path, *, warmup_steps: int, steps: int, extra: list[str]) -> dict:
    warm, warm_s = sft(work / "warmup", seed=seed, steps=warmup_steps)
    alone, alone_s = sft(work / "sft", seed=seed, steps=warmup_steps + steps)
    distilled, distill_s = distill(work / "distill", warm, teacher, seed=seed, steps=steps, extra=extra)
    row = {name: greedy_exact(path) for name, path in (("warmup", warm), ("sft", alone), ("distill", distilled))}
    row["seconds"] = {"warmup": round(warm_s), "sft": round(alone_s), "distill": round(distill_s)}
    print(f"seed {seed}: {row}", flush=True)
    return row


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--warmup-steps", type=int, default=100)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--jobs", type=int, default=1, help="seeds run side by side")
    parser.add_argument("--teacher", default="runs/sft/tiny_cpu/export")
    parser.add_argument("--out", default=str(RECORD))
    args, overrides = parser.parse_known_args(argv)
    teacher = ready_teacher(args.teacher)
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.jobs) as pool:
        runs = {seed: pool.submit(one_seed, Path(tmp) / str(seed), seed, teacher, warmup_steps=args.warmup_steps,
                                  steps=args.steps, extra=overrides) for seed in args.seeds}
        rows = {str(seed): run.result() for seed, run in runs.items()}
    record = {
        "greedy_exact": rows, "teacher_greedy_exact": greedy_exact(teacher),
        "warmup_steps": args.warmup_steps, "steps": args.steps,
        "distill_wins_every_seed": all(r["distill"] > r["sft"] for r in rows.values()),
        "inputs": fingerprint(INPUTS), "jobs": args.jobs,
        "date": datetime.date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "command": " ".join(["python scripts/distill_onpolicy_figure.py", "--seeds", *map(str, args.seeds),
                             f"--warmup-steps {args.warmup_steps} --steps {args.steps} --jobs {args.jobs}", *overrides]),
    }
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record))
    return record


if __name__ == "__main__":
    main()
