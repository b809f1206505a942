"""Rollout tokens/s: the vLLM engine vs Hugging Face generate, on the same prompts and weights.

    .venv-vllm/bin/python benchmarks/rollout_speed.py                  # tiny model, CPU (`make vllm-install`)
    .venv-vllm/bin/python benchmarks/rollout_speed.py --model PATH --dtype bfloat16 --batch 256 --new-tokens 256

Both engines sample (temperature 1, as PPO's rollouts do) ``--batch`` prompts of the arithmetic
data for ``--new-tokens`` tokens, ``--repeats`` times each, alternating between the engines so that
both see the same machine load; the first call of each is a warm-up and not counted. The weights are
the actor's (random, seeded, for a folder without weights) and reach vLLM through the same weight
sync PPO uses; its time is reported too. Prints a Markdown row for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from lightning_mem.data import PromptDataModule  # noqa: E402
from lightning_mem.models import load_causal_lm, load_tokenizer, resolve_dtype  # noqa: E402
from lightning_mem.rl.engines import RolloutEngineConfig  # noqa: E402
from lightning_mem.rl.rollout import GenerationConfig, RolloutEngine  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(REPO / "assets" / "tiny-llama"))
    parser.add_argument("--data", default=str(REPO / "data" / "arithmetic" / "prompts.jsonl"))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    args = parser.parse_args()

    from lightning_mem.rl.vllm_engine import VLLMRolloutEngine

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    actor = load_causal_lm(args.model, dtype=resolve_dtype(args.dtype)).to(device).eval()
    tokenizer = load_tokenizer(args.model)
    data = PromptDataModule(args.data, tokenizer=args.model, batch_size=args.batch, max_prompt_length=64)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
    # Each engine's rate counts the response tokens it produced (up to the end token).
    gen = GenerationConfig(max_new_tokens=args.new_tokens, temperature=1.0)
    hf = RolloutEngine(gen, eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id)
    vllm = VLLMRolloutEngine(
        gen, RolloutEngineConfig(name="vllm", max_num_seqs=args.max_num_seqs), model_path=args.model,
        eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id, dtype=actor.dtype,
    )
    start = time.perf_counter()
    vllm.start()
    start_s = time.perf_counter() - start
    start = time.perf_counter()
    synced = vllm.sync_weights(actor)
    sync_s = time.perf_counter() - start

    rates: dict[str, list[float]] = {"hf": [], "vllm": []}
    for i in range(args.repeats + 1):
        for name, engine in (("hf", hf), ("vllm", vllm)):
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            exp = engine.generate(actor, ids, mask)
            if device == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            tokens = int(exp.response_mask.sum())
            if i > 0:  # the first call of each warms up
                rates[name].append(tokens / seconds)
            print(f"{name}: {tokens} tokens in {seconds:.2f} s", file=sys.stderr)
    hf_rate, vllm_rate = statistics.median(rates["hf"]), statistics.median(rates["vllm"])
    print("| engine | rollout tokens/s (median of %d) | notes |" % args.repeats)
    print("|---|---|---|")
    print(f"| Hugging Face generate | {hf_rate:.0f} | {args.batch} prompts x {args.new_tokens} new tokens, {args.dtype}, {device} |")
    print(
        f"| vLLM (in process) | {vllm_rate:.0f} ({vllm_rate / hf_rate:.2f}x) | engine start {start_s:.1f} s;"
        f" weight sync {synced / 2**20:.1f} MiB in {sync_s:.2f} s |"
    )
    vllm.close()


if __name__ == "__main__":
    main()
