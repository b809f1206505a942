"""What ``memory_plan.empty_cache_between_phases`` costs a tiny GRPO step, and how much of it is gc.

The setting releases the allocator's cached blocks after each of the step's three phases
(``lightning_mem.rl.memory_plan.release_cached_memory``). It used to run a full ``gc.collect()``
first, which walks the whole heap (~490,000 objects once the recipes are imported); it now collects
the young generations only. This runs the tiny GRPO fit (``configs/ppo/tiny_cpu_grpo.yaml``, the
tiny model at random) in one process per variant, interleaved, and reports the seconds per GRPO
step after the first and the share of the fit spent inside the garbage collector (timed with
``gc.callbacks``), with the number of full (oldest-generation) collections:

- ``off``: the setting off;
- ``full``: the setting on, with the old release (a full collection, patched in);
- ``young``: the setting on, as shipped.

    nice -n 5 python benchmarks/phase_gc.py --steps 12 --rounds 2
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("off", "full", "young")


class GcClock:
    """Seconds inside the garbage collector and the full collections, from ``gc.callbacks``."""

    def __init__(self) -> None:
        self.seconds, self.full, self._start = 0.0, 0, 0.0
        gc.callbacks.append(self)

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            self.full += info["generation"] == 2
        else:
            self.seconds += time.perf_counter() - self._start


def child(variant: str, steps: int, root: str) -> dict:
    import torch

    import recipes.ppo as ppo
    from lightning_mem.rl import memory_plan

    if variant == "full":
        def full_release() -> None:  # the release as it was before issue 43
            gc.collect()
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.empty_cache()
        memory_plan.release_cached_memory = full_release

    clock, ends = GcClock(), []
    step = ppo.PPOModule.training_step

    def timed_step(self, *args, **kwargs):  # one GRPO step: rollout, score, train
        out = step(self, *args, **kwargs)
        ends.append((time.perf_counter(), clock.seconds, clock.full))
        return out

    ppo.PPOModule.training_step = timed_step
    on = "false" if variant == "off" else "true"
    start = time.perf_counter()
    # max_steps counts optimizer steps: two a GRPO step here (num_mini_batches: 2).
    ppo.main(["fit", "--config", str(ROOT / "configs/ppo/tiny_cpu_grpo.yaml"), f"--model.name_or_path={ROOT / 'assets/tiny-llama'}",
              f"--model.memory_plan.empty_cache_between_phases={on}", f"--trainer.max_steps={2 * steps}",
              "--trainer.logger=false", "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={root}"])
    fit_s = time.perf_counter() - start
    (t0, g0, f0), (t1, g1, f1) = ends[0], ends[-1]  # from the end of the first step (warm) to the last
    return {"variant": variant, "steps": len(ends), "step_s": (t1 - t0) / (len(ends) - 1),
            "gc_share_steps": (g1 - g0) / (t1 - t0), "full_collections": f1 - f0, "gc_share_fit": clock.seconds / fit_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="GRPO steps per fit")
    parser.add_argument("--rounds", type=int, default=2, help="each variant this many times, interleaved")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--root", default="/tmp/phase_gc", help="the fits' run folder")
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.steps, args.root)), flush=True)
        return
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    rows = []
    for _ in range(args.rounds):
        for variant in VARIANTS:
            out = subprocess.run([sys.executable, __file__, "--child", variant, "--steps", str(args.steps), "--root", args.root],
                                 cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout
            rows.append(json.loads(out.split("RESULT ", 1)[1]))
            print(rows[-1], flush=True)
    print("| variant | s per GRPO step | gc share of the steps | full collections in the steps | gc share of the fit |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['variant']} | {row['step_s']:.3f} | {100 * row['gc_share_steps']:.1f} % | {row['full_collections']}"
              f" | {100 * row['gc_share_fit']:.1f} % |")


if __name__ == "__main__":
    main()
