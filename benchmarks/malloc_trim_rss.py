"""Does ``malloc_trim(0)`` after a phase boundary lower host RSS? Measured, on glibc malloc.

The PPO memory plan moves optimizer state to the host around the rollout and back for training
(``PhaseMemoryPlan``). Each move allocates fresh host buffers and frees the old ones. glibc serves
buffers above its mmap threshold with ``mmap`` and returns them on free, but the first such free
raises the threshold to that buffer's size (up to 32 MiB): from then on, buffers of the same sizes
come from the heap, and freed heap chunks stay resident unless they sit at the top of the heap.

This times rollout -> train cycles of a PhaseMemory over an AdamW state shaped like a few layers
of Qwen2.5-0.5B (fp32: 17 MiB MLP matrices, 3 MiB attention projections, small biases and norms),
with ``trim_host_memory`` off and on, each in its own process, interleaved A, B, A, B. It prints
the RSS after each train phase (state back where training wants it, host copies freed) and the
state's own bytes, then the markdown row.

    OMP_NUM_THREADS=1 nice -n 5 python benchmarks/malloc_trim_rss.py --layers 6 --cycles 20 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def one_run(layers: int, cycles: int, trim: bool) -> dict:
    import torch
    from torch import nn

    from lightning_mem.allocator import host_allocator
    from lightning_mem.rl.memory_plan import PhaseMemory, PhaseMemoryPlan, PhasePlacement

    torch.manual_seed(0)
    hidden, inter, kv = 896, 4864, 128  # Qwen2.5-0.5B's shapes
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(hidden, hidden), nn.Linear(hidden, kv), nn.Linear(hidden, kv), nn.Linear(hidden, hidden, bias=False),
                   nn.Linear(hidden, inter, bias=False), nn.Linear(hidden, inter, bias=False), nn.Linear(inter, hidden, bias=False),
                   nn.LayerNorm(hidden), nn.LayerNorm(hidden)]
    model = nn.ModuleList(blocks)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # state exists
    for p in model.parameters():
        p.grad = None
    state_bytes = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t))
    plan = PhaseMemoryPlan(rollout=PhasePlacement(actor_optimizer="host"), score=PhasePlacement(actor_optimizer="host"),
                           trim_host_memory=trim)
    memory = PhaseMemory(plan, actor_optimizer=optimizer)
    after_train = []
    start = time.perf_counter()
    for _ in range(cycles):
        memory.place("rollout")
        # The rollout's own short-lived host tensors (generated ids, logits of a small batch).
        scratch = [torch.randn(64, 1024) for _ in range(32)]
        del scratch
        memory.place("train")
        after_train.append(rss_bytes())
    seconds = time.perf_counter() - start
    return dict(trim=trim, allocator=host_allocator(), state_bytes=state_bytes, rss_after_train=after_train, seconds=seconds)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--cycles", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--child", choices=["trim", "notrim"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(one_run(args.layers, args.cycles, args.child == "trim")))
        return
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    results: dict[str, list[dict]] = {"notrim": [], "trim": []}
    for repeat in range(args.repeats):
        for mode in ("notrim", "trim"):
            out = subprocess.run([sys.executable, __file__, "--layers", str(args.layers), "--cycles", str(args.cycles), "--child", mode],
                                 cwd=ROOT, env=env, check=True, capture_output=True, text=True).stdout
            result = json.loads(out.strip().splitlines()[-1])
            results[mode].append(result)
            mib = [v / 2**20 for v in result["rss_after_train"]]
            print(f"repeat {repeat} {mode:7s} [{result['allocator']}] state {result['state_bytes'] / 2**20:.0f} MiB;"
                  f" RSS after train phase: first {mib[0]:.0f}, max {max(mib):.0f}, last {mib[-1]:.0f} MiB;"
                  f" {result['seconds'] / args.cycles * 1e3:.0f} ms/cycle", flush=True)

    def summary(mode: str) -> tuple[float, float, float]:
        runs = results[mode]
        last = sum(r["rss_after_train"][-1] for r in runs) / len(runs) / 2**20
        peak = max(max(r["rss_after_train"]) for r in runs) / 2**20
        ms = sum(r["seconds"] for r in runs) / len(runs) / args.cycles * 1e3
        return last, peak, ms

    state = results["trim"][0]["state_bytes"] / 2**20
    (a_last, a_peak, a_ms), (b_last, b_peak, b_ms) = summary("notrim"), summary("trim")
    print(f"| {time.strftime('%Y-%m-%d')} | malloc_trim after a phase, {args.layers} Qwen2.5-0.5B-shaped layers"
          f" ({state:.0f} MiB AdamW state), {args.cycles} rollout->train cycles x {args.repeats}, interleaved |"
          f" `python benchmarks/malloc_trim_rss.py --layers {args.layers} --cycles {args.cycles} --repeats {args.repeats}` |"
          f" RSS after the train phase: off {a_last:.0f} MiB (max {a_peak:.0f}), on {b_last:.0f} MiB (max {b_peak:.0f});"
          f" cycle {a_ms:.0f} vs {b_ms:.0f} ms |")


if __name__ == "__main__":
    main()
