"""The logits path, chunked vs unchunked: exact bytes at a real vocabulary, tokens/s, and step time.

    python benchmarks/logits.py                 # both tables, CPU (about a minute)
    python benchmarks/logits.py --skip-speed    # bytes only
    python benchmarks/logits.py --skip-speed --chunk-size auto   # the library's automatic size
    python benchmarks/logits.py --step --tokens 128 --chunks 0,32,16 --rounds 3   # step time, ~10 min on CPU

Step time (``--step``): forward + backward of the Qwen2.5-0.5B architecture (the config in
``assets/hub``, random fp32 weights, tied embeddings, vocabulary 151,936) on one row of
``--tokens`` scored tokens under Lightning's bf16-mixed autocast (``cache_enabled=False``), for a
bare loop (the model's full logits, fp32 log-softmax), the fused logits path and the module-call
path it replaced (the same output layer with a no-op hook, so it is called chunk by chunk with a
checkpoint recompute), each at every ``--chunks`` size (0: unchunked). Rounds alternate between
all of them, so load from other jobs falls on each alike; the median step is reported. The
optimizer step is left out: it is the same for every variant, and without it the comparison is
stricter.

Bytes: the tiny Llama architecture with Qwen2.5's vocabulary (151,936), 4,096 scored tokens, run on
fake tensors under torch's MemTracker (exact per-category bytes, no real memory). The figure is
the peak of tracked bytes above the weights, as a multiple of one micro-batch's bf16 logits
(4,096 x 151,936 x 2 B = 1.16 GiB), for an SFT step (forward + backward), the PPO score pass
(no gradients) and a PPO train micro-batch (entropy as a metric, hidden states for a value head).

Speed: SFT training steps (forward + backward + AdamW) of the shipped tiny model on the shipped
arithmetic data, tokens/s, chunked vs unchunked, on whatever device runs it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lightning_mem.logits import next_token_targets, score_tokens  # noqa: E402

VOCAB, SCORED = 151_936, 4096


def _big_vocab_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, head_dim=32, max_position_embeddings=2048,
    )
    return LlamaForCausalLM(config)


def _inputs(rows: int, width: int, unscored: int) -> list[torch.Tensor]:
    ids = torch.randint(0, VOCAB, (rows, width))
    labels = ids.clone()
    labels[:, :unscored] = -100
    positions, targets = next_token_targets(ids, labels)
    assert positions.numel() == SCORED
    return [ids, torch.ones_like(ids), positions, targets]


def peak_multiple(kind: str, chunk_size: int | str | None) -> float:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    real = _inputs(4, 1025, 0) if kind == "sft" else _inputs(4, 1056, 32)
    mode = FakeTensorMode()
    with mode:
        model = _big_vocab_model()
        ids, mask, positions, targets = [mode.from_tensor(t) for t in real]
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            if kind == "score":
                with torch.no_grad():
                    score_tokens(model, ids, mask, positions, targets, chunk_size=chunk_size)
            else:
                train = kind == "ppo_train"
                out = score_tokens(model, ids, mask, positions, targets, chunk_size=chunk_size,
                                   with_entropy=train, entropy_grad=False, with_hidden=train)
                loss = -out.logprobs.sum()
                if train:
                    loss = loss + out.hidden.float().square().mean()
                loss.backward()
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    weights = sum(v for k, v in peak.items() if k != "Total" and getattr(k, "value", "") in ("Parameter", "Buffer"))
    return (peak["Total"] - weights) / (SCORED * VOCAB * 2)


def sft_tokens_per_second(chunk_size: int | str | None, steps: int, device: str) -> float:
    from lightning_mem.data import SFTDataModule
    from lightning_mem.models import load_causal_lm

    torch.manual_seed(0)
    tiny = str(ROOT / "assets" / "tiny-llama")
    model = load_causal_lm(tiny).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = SFTDataModule(str(ROOT / "data" / "arithmetic" / "train.jsonl"), tokenizer=tiny, max_length=64,
                         max_tokens_per_batch=1024)
    data.setup()
    loader = iter(data.train_dataloader())
    times, tokens = [], 0
    for step in range(steps + 3):
        batch = {k: v.to(device) for k, v in next(loader).items() if k != "step_label_tokens"}
        start = time.perf_counter()
        positions, targets = next_token_targets(batch["input_ids"], batch["labels"])
        out = score_tokens(model, batch["input_ids"], batch["attention_mask"], positions, targets, chunk_size=chunk_size)
        (-out.logprobs.sum() / targets.numel()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        if step >= 3:  # warm-up steps left out
            times.append(time.perf_counter() - start)
            tokens += int(batch["attention_mask"].sum())
    return tokens / sum(times)


def step_times(tokens: int, chunks: list[int], rounds: int, steps: int, layers: int | None = None,
               cpu_time: bool = False) -> dict[str, float]:
    """Median seconds per forward + backward for each variant (see the module's docstring)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(ROOT / "assets/hub/Qwen/Qwen2.5-0.5B-Instruct"))
    if layers:  # fewer blocks: the output layer is a larger share of the step (a stricter comparison)
        config.num_hidden_layers = layers
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()
    ids = torch.randint(0, config.vocab_size, (1, tokens + 1))
    mask = torch.ones_like(ids)
    labels = ids.clone()
    positions, targets = next_token_targets(ids, labels)

    def bare() -> None:
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[0, :-1]
        logp = torch.log_softmax(logits.float(), dim=-1)
        (-logp.gather(-1, targets.unsqueeze(-1)).sum() / targets.numel()).backward()

    def scored(chunk: int) -> None:
        out = score_tokens(model, ids, mask, positions, targets, chunk_size=chunk or None)
        (-out.logprobs.sum() / targets.numel()).backward()

    def module_call(chunk: int) -> None:
        handle = model.get_output_embeddings().register_forward_hook(lambda *_: None)  # not fusable: the old path
        try:
            scored(chunk)
        finally:
            handle.remove()

    variants = {"bare loop (full logits)": bare}
    for chunk in chunks:
        rows = chunk or tokens
        label = f"{-(-tokens // rows)} chunk{'s' if rows < tokens else ''} of {rows}"
        variants[f"fused, {label}"] = lambda c=chunk: scored(c)
        variants[f"module call, {label}"] = lambda c=chunk: module_call(c)
    clock = time.process_time if cpu_time else time.perf_counter
    times: dict[str, list[float]] = {name: [] for name in variants}
    for index in range(rounds):
        for name, run in variants.items():
            for step in range(steps + (index == 0)):
                model.zero_grad(set_to_none=True)
                start = clock()
                with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):  # Lightning's bf16-mixed
                    run()
                if index or step:  # each variant's first step is a warm-up
                    times[name].append(clock() - start)
        print(f"round {index + 1}/{rounds}: " + ", ".join(f"{k} {statistics.median(v):.2f} s" for k, v in times.items()),
              file=sys.stderr, flush=True)
    return {name: statistics.median(v) for name, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chunk-size", type=lambda v: v if v == "auto" else int(v), default=512,
                        help="rows per chunk, or auto (lightning_mem.logits.rows_per_chunk)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3, help="speed rounds, alternating; the median is reported")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--step", action="store_true", help="only the step-time table at the Qwen2.5-0.5B architecture")
    parser.add_argument("--tokens", type=int, default=128, help="scored tokens per step for --step")
    parser.add_argument("--chunks", default="0,32,16", help="chunk sizes for --step (0: unchunked)")
    parser.add_argument("--step-repeats", type=int, default=2, help="timed steps per variant and round for --step")
    parser.add_argument("--layers", type=int, default=None, help="decoder blocks for --step (default: the config's 24)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="--step times the process's CPU time (steadier than wall time on a loaded machine;"
                             " use with --threads 1)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.step:
        medians = step_times(args.tokens, [int(c) for c in args.chunks.split(",")], args.rounds, args.step_repeats,
                             args.layers, args.cpu_time)
        bare = medians["bare loop (full logits)"]
        blocks = f", {args.layers} of 24 blocks" if args.layers else ""
        what = "CPU time" if args.cpu_time else "wall time"
        print(f"| Qwen2.5-0.5B arch.{blocks}, {args.tokens} tokens, bf16 autocast | forward + backward ({what}) |"
              " vs bare loop |"
              "\n|---|---|---|")
        for name, seconds in medians.items():
            print(f"| {name} | {seconds:.2f} s | {seconds / bare:.3f} |")
        return
    print(f"| pass | unchunked | chunked ({args.chunk_size}) |\n|---|---|---|")
    for kind in ("sft", "score", "ppo_train"):
        print(f"| {kind} | {peak_multiple(kind, None):.2f}x | {peak_multiple(kind, args.chunk_size):.2f}x |")
    if args.skip_speed:
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    speeds: dict[str, list[float]] = {"unchunked": [], "chunked": []}
    for _ in range(args.rounds):
        speeds["unchunked"].append(sft_tokens_per_second(None, args.steps, device))
        speeds["chunked"].append(sft_tokens_per_second(args.chunk_size, args.steps, device))
    med = {k: statistics.median(v) for k, v in speeds.items()}
    print(f"\nSFT tokens/s on {device} (tiny model, median of {args.rounds}): unchunked {med['unchunked']:.0f},"
          f" chunked {med['chunked']:.0f} ({med['chunked'] / med['unchunked']:.2f}x)")


if __name__ == "__main__":
    main()
