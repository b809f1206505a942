"""Where the SFT recipe's step spends its time beside a bare loop's, by op: the same batches as
``benchmarks/gpu/step_time.py``, each side under ``torch.profiler`` for a few steps after the warm-up.

    python -m benchmarks.gpu.profile_step --out runs/gpu                       # Qwen2.5-0.5B arch., CUDA
    python -m benchmarks.gpu.profile_step --device cpu --model assets/tiny-llama --rows 2 --tokens 64

For each side it writes ``profile_<side>.txt``: the ops by total device time (self CPU time on a
CPU), with their counts, and the host synchronisations seen (``cudaStreamSynchronize``,
``cudaDeviceSynchronize``, device-to-host copies). What a step time hides, this shows: a cast per
chunk, an fp32 matmul, a sync in the middle of the step.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from benchmarks import step_time as cpu_bench
from benchmarks.gpu.step_time import model_folder

ROOT = Path(__file__).resolve().parents[2]
#: Host-side calls that wait for the device (a sync in the middle of a step stalls the queue).
SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaMemcpyAsync", "aten::item",
               "aten::_local_scalar_dense", "aten::nonzero")


@dataclass
class ProfiledSetup(cpu_bench.Setup):
    """A ``Setup`` whose clock, read once per batch by both sides, also advances the profiler."""

    profiler: Any = None

    def now(self) -> float:
        value = super().now()
        if self.profiler is not None:
            self.profiler.step()
        return value


def profiled(run: Any, setup: ProfiledSetup, active: int) -> Any:
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if setup.device == "cuda" else [])
    # The first reading of the clock is before the first batch: wait out the warm-up batches, then record
    # once (a second cycle that reached its own warm-up would drop what the first recorded).
    with profile(activities=activities, schedule=schedule(wait=setup.warmup, warmup=1, active=active, repeat=1),
                 record_shapes=False) as prof:
        setup.profiler = prof
        try:
            run()
        finally:
            setup.profiler = None
    return prof


def report(prof: Any, device: str, rows: int) -> str:
    averages = prof.key_averages()
    key = "device_time_total" if device == "cuda" else "self_cpu_time_total"
    table = averages.table(sort_by=key, row_limit=rows, max_name_column_width=60)
    syncs = [f"{e.key}: {e.count}" for e in averages if e.key in SYNC_EVENTS]
    return f"{table}\nhost synchronisation events over the recorded steps: {', '.join(syncs) or 'none'}\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu.profile_step", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "runs" / "gpu"))
    parser.add_argument("--model", default="Qwen/Qwen2.5-0.5B-Instruct")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--active", type=int, default=2, help="recorded steps per side")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--table-rows", type=int, default=30)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here (the CPU side: --device cpu)")
    folder = model_folder(args.model)
    count = args.warmup + 1 + args.active + 1
    data = [{k: v.to(args.device) for k, v in b.items()}
            for b in cpu_bench.synthetic_batches(count, args.rows, args.tokens, cpu_bench.vocab_size_of(folder))]
    setup = ProfiledSetup(model=folder, device=args.device, precision=args.precision, fused=True, lr=1e-5,
                          chunk_size=None, warmup=args.warmup, sync=args.device == "cuda")
    args.out.mkdir(parents=True, exist_ok=True)
    sides = {"bare": lambda: cpu_bench.bare_steps(data, setup, "hf"), "recipe": lambda: cpu_bench.recipe_steps(data, setup)}
    for side, run in sides.items():
        text = report(profiled(run, setup, args.active), args.device, args.table_rows)
        head = (f"{side}: {args.model}, {args.rows} x {args.tokens} tokens, {args.precision}, fused AdamW, clip 1.0;"
                f" {args.active} steps recorded after {args.warmup} + 1\n")
        (args.out / f"profile_{side}.txt").write_text(head + text)
        print(head + text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
