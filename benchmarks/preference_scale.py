"""The preference data path at scale, in one process: the time to build the Arrow cache of N
generated pairs, the time of a second start (cache hit), and the private memory that the pair set and
its training sampler keep per pair.

    python benchmarks/preference_scale.py generate --pairs 100000 --out /tmp/pairs_100k.jsonl
    python benchmarks/preference_scale.py run --data /tmp/pairs_100k.jsonl --num-proc 2

``generate`` writes seeded synthetic pairs whose lengths look like real preference data: prompt and
response lengths (characters; the tiny tokenizer is about one token a character) log-normal with
medians ``--prompt-median`` and ``--response-median`` (140 and 260 by default, long right tails,
clipped to 4096), the three row shapes in turn (strings, TRL's conversational form, whole
conversations sharing their prompt), and a ``margin`` on every fifth row.

``run`` builds the cache (``PreferenceDataModule.prepare_data`` with ``--num-proc`` processes) into a
fresh folder (or ``--cache-dir``, kept), then starts on it as a rank does: ``setup`` (open the
memory-mapped pairs) and the training loader of rank 0 of 2 (its sampler plans the epoch: budget
``--max-tokens``, accumulation 2, the step totals carried), timed, and reads ``--batches``
micro-batches. A third start is traced by ``tracemalloc`` (numpy reports its arrays to it): the
bytes the pair set and its sampler keep, and their peak while planning, per pair -- private memory
of each rank; the token ids stay in the memory-mapped cache, shared by the ranks. Prints one JSON
line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORDS = np.array("the of a to and is in that for on with as what how why can you explain number list write "
                 "answer step first then sum total value code function data model train time make give".split())


def _text(rng: np.random.Generator, chars: int) -> str:
    return " ".join(WORDS[rng.integers(0, len(WORDS), size=chars // 4 + 1)])[:chars]


def generate(pairs: int, out: Path, seed: int = 0, prompt_median: float = 140, response_median: float = 260) -> None:
    rng = np.random.default_rng(seed)
    prompts = np.clip(rng.lognormal(np.log(prompt_median), 0.9, size=pairs), 8, 4096).astype(int)
    responses = np.clip(rng.lognormal(np.log(response_median), 0.8, size=(pairs, 2)), 2, 4096).astype(int)
    with out.open("w") as f:
        for i in range(pairs):
            p = _text(rng, int(prompts[i]))
            chosen, rejected = _text(rng, int(responses[i, 0])), "no " + _text(rng, int(responses[i, 1]))
            if i % 3 == 0:
                row = {"prompt": p, "chosen": chosen, "rejected": rejected}
            elif i % 3 == 1:
                row = {"prompt": [{"role": "user", "content": p}], "chosen": [{"role": "assistant", "content": chosen}],
                       "rejected": [{"role": "assistant", "content": rejected}]}
            else:
                user = {"role": "user", "content": p}
                row = {"chosen": [user, {"role": "assistant", "content": chosen}],
                       "rejected": [user, {"role": "assistant", "content": rejected}]}
            if i % 5 == 0:
                row["margin"] = round(float(rng.random()), 3)
            f.write(json.dumps(row) + "\n")
    print(f"generate: {out} ({out.stat().st_size / 1e6:.0f} MB, {pairs} pairs)", file=sys.stderr)


def _trainer(rank: int, replicas: int = 2, accumulate: int = 2) -> SimpleNamespace:
    progress = SimpleNamespace(total=SimpleNamespace(processed=0))
    return SimpleNamespace(strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": replicas, "rank": rank}),
                           world_size=replicas, global_rank=rank, accumulate_grad_batches=accumulate,
                           fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress)))


def run(data: Path, num_proc: int, max_length: int, max_tokens: int, batches: int, packing: bool,
        cache_dir: Path | None = None) -> dict:
    import tracemalloc

    from lightning_mem.data import PreferenceDataModule

    cache = cache_dir or Path(tempfile.mkdtemp(prefix="preference_scale_"))

    def start() -> PreferenceDataModule:
        dm = PreferenceDataModule(train_file=str(data), tokenizer=str(ROOT / "assets/tiny-llama"), max_length=max_length,
                                  batch_size=None, max_tokens_per_batch=max_tokens, num_proc=num_proc, cache_dir=str(cache),
                                  packing=packing)
        dm.trainer = _trainer(0)
        return dm

    try:
        dm = start()
        t0 = time.perf_counter()
        dm.prepare_data()
        built_s = time.perf_counter() - t0
        second = start()
        t0 = time.perf_counter()
        second.setup("fit")
        loader = second.train_dataloader()
        started_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        read = [b for _, b in zip(range(batches), loader)]
        read_s = time.perf_counter() - t0
        third = start()
        third._load_tokenizer()
        tracemalloc.start()
        third.setup("fit")
        third.train_dataloader()
        kept, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        stats, pairs = second.stats["train"], len(second.train_set)
        return {
            "pairs": stats.rows, "kept": pairs, "truncated": stats.truncated, "dropped": stats.dropped + stats.identical,
            "num_proc": num_proc, "max_length": max_length, "max_tokens_per_batch": max_tokens, "packing": packing,
            "cache_gb": round(sum(f.stat().st_size for f in cache.rglob("*") if f.is_file()) / 1e9, 3),
            "build_s": round(built_s, 1), "cache_hit_setup_and_plan_s": round(started_s, 2),
            f"read_{batches}_batches_s": round(read_s, 2), "micro_batches_per_rank": len(loader.sampler),
            "pairs_per_batch": round(float(np.mean([len(b["pair_index"]) for b in read])), 1),
            "kept_bytes_per_pair": round(kept / pairs, 1), "peak_bytes_per_pair": round(peak / pairs, 1),
            "kept_mb": round(kept / 1e6, 1), "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_1m": round(os.getloadavg()[0], 2),
        }
    finally:
        if cache_dir is None:
            shutil.rmtree(cache, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="write the synthetic pairs")
    gen.add_argument("--pairs", type=int, default=100_000)
    gen.add_argument("--out", type=Path, required=True)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--prompt-median", type=float, default=140)
    gen.add_argument("--response-median", type=float, default=260)
    go = sub.add_parser("run", help="build the cache, open it, plan and read micro-batches")
    go.add_argument("--data", type=Path, required=True)
    go.add_argument("--num-proc", type=int, default=2)
    go.add_argument("--max-length", type=int, default=512)
    go.add_argument("--max-tokens", type=int, default=8192)
    go.add_argument("--batches", type=int, default=8)
    go.add_argument("--packing", action="store_true")
    go.add_argument("--cache-dir", type=Path, default=None, help="keep the cache here (a second run reuses it)")
    args = parser.parse_args()
    if args.command == "generate":
        generate(args.pairs, args.out, args.seed, args.prompt_median, args.response_median)
        return
    print(json.dumps(run(args.data, args.num_proc, args.max_length, args.max_tokens, args.batches, args.packing,
                         args.cache_dir)), flush=True)


if __name__ == "__main__":
    main()
