"""The estimator's per-rank peak of one real model at 4k, 16k and 64k tokens, per parallelism
technique: the table in docs/parallelism.md ("Choosing").

    OMP_NUM_THREADS=1 nice -n 5 python benchmarks/parallel_estimates.py --out runs/parallel_estimates.json

Qwen2.5-7B-Instruct GRPO on 8 x 80 GB (``configs/ppo/qwen2.5-7b-instruct_grpo_8x80gb_cp4.yaml``:
FSDP2 on 8 ranks, bf16 compute on fp32 shards, every block checkpointed), each sequence a
512-token prompt and a response filling the rest of the token count. Every cell is one
``python -m lightning_mem.estimate --json`` run (the recipe's own fit on fake tensors, a fresh
process each) with the technique's strategy overrides. Each micro-batch holds one whole sequence
per context group (the token budgets are per rank), so the cells of a row differ by the technique
alone. Prints each cell as it finishes; ``--out`` keeps every phase's figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = "configs/ppo/qwen2.5-7b-instruct_grpo_8x80gb_cp4.yaml"
PROMPT = 512
TOKENS = (4096, 16384, 65536)
STRATEGY = "--trainer.strategy.init_args."
#: name -> (context-parallel size, tensor-parallel size, strategy overrides)
TECHNIQUES: dict[str, tuple[int, int, list[str]]] = {
    "FSDP2": (1, 1, ["cpu_offload=false"]),
    "FSDP2 + CPU offload": (1, 1, ["cpu_offload=true"]),
    "CP 4": (4, 1, ["cpu_offload=false"]),
    "TP 2 + SP, CP 2": (2, 2, ["cpu_offload=false", "tensor_parallel_size=2", "sequence_parallel=true"]),
}


def overrides(tokens: int, cp: int, tp: int, strategy: list[str]) -> list[str]:
    per_rank = tokens // cp  # one whole sequence per micro-batch of the context group
    return [
        f"{STRATEGY}context_parallel_size={cp}", *(STRATEGY + s for s in strategy),
        f"--data.max_prompt_length={PROMPT}",
        f"--model.generation.max_new_tokens={tokens - PROMPT}",
        f"--model.ppo.max_tokens_per_microbatch={per_rank}",
        f"--model.ppo.logprob_max_tokens_per_microbatch={per_rank}",
    ]


def estimate_cell(tokens: int, technique: str) -> dict:
    cp, tp, strategy = TECHNIQUES[technique]
    cmd = [sys.executable, "-m", "lightning_mem.estimate", "--config", CONFIG, "--json",
           *overrides(tokens, cp, tp, strategy)]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode not in (0, 1):  # 1: it does not fit, which the table shows
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout)
    result["seconds"] = time.perf_counter() - start
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write every cell's estimate here (JSON)")
    parser.add_argument("--tokens", type=int, nargs="*", default=list(TOKENS))
    parser.add_argument("--techniques", nargs="*", default=list(TECHNIQUES), choices=list(TECHNIQUES))
    args = parser.parse_args()
    cells = {}
    for tokens in args.tokens:
        for technique in args.techniques:
            result = estimate_cell(tokens, technique)
            peak = max(p["device_peak_bytes"] for p in result["phases"])
            phase = max(result["phases"], key=lambda p: p["device_peak_bytes"])["phase"]
            cells[f"{tokens}|{technique}"] = result
            print(f"{tokens:>6} tokens  {technique:<22} {peak / 2**30:7.2f} GiB per rank (peak in {phase}),"
                  f" {result['seconds']:.0f} s", flush=True)
            if args.out:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(cells, indent=1))
    print("\n| tokens | " + " | ".join(args.techniques) + " |")
    print("|---" * (len(args.techniques) + 1) + "|")
    for tokens in args.tokens:
        row = [max(p["device_peak_bytes"] for p in cells[f"{tokens}|{t}"]["phases"]) / 2**30 for t in args.techniques]
        print(f"| {tokens // 1024}k | " + " | ".join(f"{v:.1f}" for v in row) + " |")


if __name__ == "__main__":
    main()
