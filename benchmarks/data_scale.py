"""The data path at scale: time to the first step and each rank's memory (RSS, PSS, USS), for a
cold start and a second start, on a generated SFT chat set or PPO prompt set of 100k-10M rows, 2 CPU
ranks over gloo (torchrun).

    python benchmarks/data_scale.py generate --rows 1000000 --out /tmp/chat_1m.jsonl
    python benchmarks/data_scale.py generate --kind prompts --rows 1000000 --out /tmp/prompts_1m.jsonl
    python benchmarks/data_scale.py run --data /tmp/chat_1m.jsonl --code . --label after --num-proc 2
    python benchmarks/data_scale.py run --recipe ppo --data /tmp/prompts_1m.jsonl --num-proc 2
    python benchmarks/data_scale.py run --data /tmp/chat_100k.jsonl --code /tmp/before --label before

``generate`` writes a seeded synthetic chat set whose lengths look like real instruction data:
prompt and response lengths (characters; the tiny tokenizer is one token a character) drawn from
log-normal distributions (medians 140 and 260, long right tails, clipped to 4096), four in five
rows ``prompt``/``completion`` and one in five a two-turn ``messages`` conversation.

``--kind prompts`` writes PPO prompt rows (``prompt`` of the same prompt lengths, ``answer``).
``--prompt-median``/``--response-median`` set the two medians (characters, so tokens): short rows
(e.g. 8 and 8) make a 10M-row set that tokenizes in minutes, not hours, for the memory that grows
with the row count (a rank's private memory per row holds no token: the ids stay in the
memory-mapped cache; what grows per row is row positions, lengths and the sampler's plan, a few
bytes each whatever a row's length).

``run`` starts the SFT recipe (``configs/sft/tiny_cpu.yaml``; ``--recipe ppo``:
``configs/ppo/tiny_cpu.yaml`` from the random-init tiny model) under ``torchrun``, 2 ranks, the
checkout ``--code``, on that file for one step, twice: a cold start (an empty tokenized cache for
code that has one) and a second start (the cache of the first). A callback (written to a temporary
folder and put on ``PYTHONPATH``, so that any checkout can run it) records on every rank, at the
end of the first training step, the wall time since the launch, the rank's peak RSS (``getrusage``
``ru_maxrss``: the largest the process ever was) and, from ``psutil``'s ``memory_full_info()``:

- ``rss``: resident pages, shared ones included: the memory-mapped token ids count here once
  touched, in every rank, though the page cache holds them once per machine;
- ``pss``: each shared page divided by the processes that map it: summed over the ranks, what
  they take from the machine;
- ``uss``: pages only this rank holds (its heap, its private arrays): what each more rank adds.

Run it once on a file of a few hundred rows for the no-data start that the others are read
against. Prints one JSON line per start.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

PROBE = '''
import json, os, resource, time
import psutil
from lightning.pytorch.callbacks import Callback

class FirstStepProbe(Callback):
    """Writes the time and this rank's memory (peak RSS; RSS, PSS, USS now) at the end of the first
    training step."""
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 0:
            out = os.environ["DATA_SCALE_PROBE"]
            now = psutil.Process().memory_full_info()
            with open(f"{out}/rank{trainer.global_rank}.json", "w") as f:
                json.dump({"t": time.time(), "peak_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                           "rss": now.rss, "pss": now.pss, "uss": now.uss}, f)
            trainer.should_stop = True  # every rank runs this, so they stop together
'''

WORDS = np.array("the of a to and is in that for on with as what how why can you explain number list write "
                 "answer step first then sum total value code function data model train time make give".split())


def _text(rng: np.random.Generator, chars: int) -> str:
    words = WORDS[rng.integers(0, len(WORDS), size=chars // 4 + 1)]
    return " ".join(words)[:chars]


def generate(rows: int, out: Path, seed: int = 0, kind: str = "chat", prompt_median: float = 140, response_median: float = 260) -> None:
    rng = np.random.default_rng(seed)
    prompt_len = np.clip(rng.lognormal(np.log(prompt_median), 0.9, size=rows), min(8, prompt_median), 4096).astype(int)
    response_len = np.clip(rng.lognormal(np.log(response_median), 0.8, size=rows), 2, 4096).astype(int)
    conversation = rng.random(rows) < 0.2
    step = max(rows // 20, 1)
    with out.open("w") as f:
        for i in range(rows):
            p, r = _text(rng, int(prompt_len[i])), _text(rng, int(response_len[i]))
            if kind == "prompts":
                row = {"prompt": p, "answer": str(int(response_len[i]))}
            elif conversation[i]:
                half_p, half_r = len(p) // 2, len(r) // 2
                row = {"messages": [{"role": "user", "content": p[:half_p]}, {"role": "assistant", "content": r[:half_r]},
                                    {"role": "user", "content": p[half_p:] or "go on"}, {"role": "assistant", "content": r[half_r:] or "ok"}]}
            else:
                row = {"prompt": p, "completion": r}
            f.write(json.dumps(row) + "\n")
            if (i + 1) % step == 0:
                print(f"generate: {i + 1}/{rows} rows", file=sys.stderr, flush=True)
    print(f"generate: {out} ({out.stat().st_size / 1e6:.0f} MB); prompt chars median {np.median(prompt_len):.0f},"
          f" p99 {np.percentile(prompt_len, 99):.0f}; response chars median {np.median(response_len):.0f},"
          f" p99 {np.percentile(response_len, 99):.0f}", file=sys.stderr)


#: Each recipe's command line after ``--config``: its data on the generated file, one step's worth.
RECIPE_ARGS = {
    "sft": ["--data.val_file", "null", "--data.max_length", "256", "--data.max_tokens_per_batch", "1024",
            "--trainer.max_steps", "100"],
    "ppo": ["--data.max_prompt_length", "256", "--data.batch_size", "4", "--model.generation.max_new_tokens", "4",
            "--trainer.max_epochs", "1"],
}


def _per_rank(ranks: list[dict], key: str) -> list[float]:
    return [round(r[key] / 1e9, 3) for r in ranks]


def start(code: Path, data: Path, extra: list[str], threads: int, timeout: int, recipe: str = "sft") -> dict:
    """One 2-rank start of a recipe, stopped after its first step; the probe's figures per rank.
    (SFT's ``max_steps`` stays a real run's size: the recipe refuses a warm-up longer than the run.)"""
    probe_dir = Path(tempfile.mkdtemp(prefix="data_scale_"))
    (probe_dir / "first_step_probe.py").write_text(PROBE)
    env = {**os.environ, "PYTHONPATH": f"{code}:{probe_dir}", "DATA_SCALE_PROBE": str(probe_dir),
           "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", f"recipes.{recipe}", "fit",
        "--config", str(code / f"configs/{recipe}/tiny_cpu.yaml"), "--trainer.devices", "2",
        "--trainer.default_root_dir", str(probe_dir / "run"), "--trainer.limit_val_batches", "0",
        "--trainer.callbacks+=first_step_probe.FirstStepProbe", "--model.name_or_path", str(code / "assets/tiny-llama"),
        "--data.train_file", str(data), *RECIPE_ARGS[recipe], *extra,
    ]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=code, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.time() - t0
    ranks = [json.loads((probe_dir / f"rank{r}.json").read_text()) for r in range(2) if (probe_dir / f"rank{r}.json").exists()]
    if proc.returncode != 0 or len(ranks) != 2:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-8000:])
        raise SystemExit(f"run failed (rc={proc.returncode})")
    shutil.rmtree(probe_dir, ignore_errors=True)
    return {
        "first_step_s": round(max(r["t"] for r in ranks) - t0, 1),
        "peak_rss_gb_per_rank": [round(r["peak_rss_kb"] / 1e6, 2) for r in ranks],
        **({f"{key}_gb_per_rank": _per_rank(ranks, key) for key in ("rss", "pss", "uss")} if "uss" in ranks[0] else {}),
        "process_wall_s": round(wall, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="write the synthetic chat set")
    gen.add_argument("--rows", type=int, default=1_000_000)
    gen.add_argument("--out", type=Path, required=True)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--kind", choices=("chat", "prompts"), default="chat", help="SFT chat rows or PPO prompt rows")
    gen.add_argument("--prompt-median", type=float, default=140, help="median prompt length, characters (= tokens)")
    gen.add_argument("--response-median", type=float, default=260, help="median response length, characters (= tokens)")
    run = sub.add_parser("run", help="cold and second start of a checkout on a data file")
    run.add_argument("--data", type=Path, required=True)
    run.add_argument("--code", type=Path, default=ROOT, help="the checkout to run (its recipes and lightning_mem)")
    run.add_argument("--label", default="")
    run.add_argument("--recipe", choices=tuple(RECIPE_ARGS), default="sft")
    run.add_argument("--num-proc", type=int, default=None, help="data.num_proc (code with a tokenized cache only)")
    run.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each rank")
    run.add_argument("--starts", type=int, default=2, help="starts in a row: the first cold, the others on its cache")
    run.add_argument("--timeout", type=int, default=7200)
    args = parser.parse_args()
    if args.command == "generate":
        generate(args.rows, args.out, args.seed, args.kind, args.prompt_median, args.response_median)
        return
    code = args.code.resolve()
    cached = (code / "lightning_mem/data/cache.py").exists()
    extra, cache_dir = [], None
    if cached:
        cache_dir = Path(tempfile.mkdtemp(prefix="data_scale_cache_"))
        extra = ["--data.cache_dir", str(cache_dir)] + (["--data.num_proc", str(args.num_proc)] if args.num_proc else [])
    try:
        for i in range(args.starts):
            result = start(code, args.data.resolve(), extra, args.threads, args.timeout, args.recipe)
            row = {"label": args.label, "recipe": args.recipe, "start": "cold" if i == 0 else "second", "rows": sum(1 for _ in args.data.open("rb")),
                   "cache": cached, "num_proc": args.num_proc if cached else None, **result,
                   "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_1m": round(os.getloadavg()[0], 2)}
            print(json.dumps(row), flush=True)
    finally:
        if cache_dir is not None:
            shutil.rmtree(cache_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
