"""torch.optim.AdamW's step: fused against foreach, on this machine's CPU, interleaved.

    python benchmarks/adamw_step.py                              # 10M params in 50 tensors, fp32 and bf16
    python benchmarks/adamw_step.py --params 20000000 --tensors 100 --rounds 12 --json

Why it matters here: a tier whose optimizer steps on the host (FSDP2 ``cpu_offload: true``) runs
this exact kernel on the CPU, and the recipes can now use the fused one under bf16 precisions
(:mod:`lightning_mem.clipping`). The two optimizers step identical copies of the same parameters
and gradients; rounds alternate which goes first, so load from other jobs falls on both alike.
Reported: the median step time of each after two warm-up rounds, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def measure(params: int, tensors: int, dtype: torch.dtype, rounds: int) -> dict[str, float]:
    torch.manual_seed(0)
    size = params // tensors
    base = [torch.randn(size, dtype=dtype) for _ in range(tensors)]
    grads = [torch.randn(size, dtype=dtype) for _ in range(tensors)]
    optimizers = {}
    for kind in ("foreach", "fused"):
        ps = [torch.nn.Parameter(b.clone()) for b in base]
        for p, g in zip(ps, grads):
            p.grad = g.clone()
        optimizers[kind] = torch.optim.AdamW(ps, lr=1e-3, **{kind: True})
    times: dict[str, list[float]] = {k: [] for k in optimizers}
    for i in range(rounds):
        for kind in ("foreach", "fused") if i % 2 else ("fused", "foreach"):
            start = time.perf_counter()
            optimizers[kind].step()
            times[kind].append(time.perf_counter() - start)
    median = {k: sorted(v[2:])[len(v[2:]) // 2] for k, v in times.items()}
    return {"foreach_ms": median["foreach"] * 1e3, "fused_ms": median["fused"] * 1e3,
            "fused_over_foreach": median["fused"] / median["foreach"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=10_000_000)
    parser.add_argument("--tensors", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    results = {str(dtype).removeprefix("torch."): measure(args.params, args.tensors, dtype, args.rounds)
               for dtype in (torch.float32, torch.bfloat16)}
    if args.json:
        print(json.dumps(results, indent=2))
        return
    for dtype, r in results.items():
        print(f"{dtype}: foreach {r['foreach_ms']:.1f} ms, fused {r['fused_ms']:.1f} ms, fused/foreach {r['fused_over_foreach']:.2f}")


if __name__ == "__main__":
    main()
