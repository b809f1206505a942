"""Padded vs packed SFT batches: tokens per second and the step's peak tensor bytes, interleaved.

    python benchmarks/packing.py                          # 3 rounds of 24 micro-batches per layout
    python benchmarks/packing.py --rounds 5 --steps 40 --threads 1 --json

The data: :func:`benchmarks.data_scale.generate`'s synthetic chat set (log-normal prompt and
response lengths, medians 140 and 260 characters, long right tails; the tiny tokenizer is one token
a character), truncated to ``--max-length``. Three layouts of the same rows under one token budget
(``--max-tokens`` per micro-batch):

- ``padded, random``: rows in random order, as many per micro-batch as the budget takes at the
  batch's longest row (``TokenBudgetSampler``'s budget rule without its length grouping);
- ``padded, sorted``: the default: rows of similar length grouped within windows of 512
  (``TokenBudgetSampler``'s default), so little padding but a length-biased order;
- ``packed``: ``data.packing: true``: whole rows best-fit-decreasing into rows of ``--max-length``,
  as many rows a micro-batch as the budget holds, random composition (``PackedBatchSampler``);
- ``packed, one row``: the same examples in one row of the whole budget, the layout that
  flash-attention's varlen kernel runs (``flatten_rows``), here under ``sdpa``;
- ``packed, one row, packed_sdpa``: that row under :mod:`lightning_mem.packed_attention`, which runs
  ``sdpa`` once per example (what the PPO recipe's packed passes use).

Under ``sdpa`` on the CPU a row's examples are isolated by a block-diagonal mask over the whole
row: attention still costs (row length)^2, where padded rows cost rows x (longest)^2. That is why
packed rows are no longer than ``max_length``; the varlen kernel (``flash_attention_2``, on a GPU)
costs only the examples' own lengths, but this benchmark cannot run it here.

Each layout trains the tiny Llama (fp32, sdpa, AdamW, the recipe's chunked logits path) on its
micro-batches; rounds alternate between the layouts so that load from other jobs falls on all
alike; the first micro-batches of a round are a warm-up. Tokens per second counts *real* tokens
(the rows' own, not padding). The peak is the largest live tensor bytes (activations, gradients,
logits path; the weights and AdamW state excluded) during one micro-batch's forward and backward,
tracked by :class:`lightning_mem.estimate.tracker.MemoryLedger` on real CPU tensors.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
WARMUP = 3
LAYOUTS = ("padded, random", "padded, sorted", "packed", "packed, one row", "packed, one row, packed_sdpa")


def micro_batches(data: Path, layout: str, count: int, max_length: int, max_tokens: int) -> list[dict[str, torch.Tensor]]:
    """The first ``count`` training micro-batches of ``layout``, as the SFT datamodule collates them."""
    from torch.utils.data import DataLoader

    from lightning_mem.batching import TokenBudgetSampler
    from lightning_mem.data import SFTDataModule

    from lightning_mem.batching import pack_by_token_budget

    class RandomOrder(TokenBudgetSampler):
        def _group(self, order: list[int]) -> list[list[int]]:
            return pack_by_token_budget(order, self.lengths, self.max_tokens)

    from lightning_mem.data.packing import PackedBatchSampler, PackedCollator

    dm = SFTDataModule(train_file=str(data), tokenizer=str(ROOT / "assets/tiny-llama"), max_length=max_length,
                       max_tokens_per_batch=max_tokens, packing=layout.startswith("packed"),
                       cache_dir=str(data.parent / "cache"))
    dm.setup("fit")
    if layout == "padded, random":  # the datamodule's own collator; the sampler without length grouping
        sampler = RandomOrder(dm.train_set.lengths, max_tokens=max_tokens, seed=0)
        loader = DataLoader(dm.train_set, sampler=sampler, batch_size=None, collate_fn=dm.train_dataloader().collate_fn)
    elif layout.startswith("packed, one row"):
        sampler = PackedBatchSampler(dm.train_set.lengths, max_tokens=max_tokens, seed=0)
        loader = DataLoader(dm.train_set, sampler=sampler, batch_size=None, collate_fn=PackedCollator())
    else:
        loader = dm.train_dataloader()
    out = []
    for batch in loader:
        out.append({k: v for k, v in batch.items() if isinstance(v, torch.Tensor)})
        if len(out) == count:
            break
    return out


def real_tokens(batch: dict[str, torch.Tensor]) -> int:
    if "row_tokens" in batch:
        return int(batch["row_tokens"].sum())
    return int(batch["attention_mask"].sum())


def examples(batch: dict[str, torch.Tensor]) -> int:
    if "row_tokens" not in batch:
        return batch["input_ids"].shape[0]
    starts = batch["position_ids"] == 0  # each example starts at position 0; the rows' end padding too
    return sum(int(starts[r, :n].sum()) for r, n in enumerate(batch["row_tokens"].tolist()))


def _model(layout: str):
    from lightning.pytorch import seed_everything

    from lightning_mem.models import load_causal_lm
    from lightning_mem.packed_attention import use_packed_sdpa

    seed_everything(0, verbose=False)
    model = load_causal_lm(str(ROOT / "assets/tiny-llama"), attn_implementation="sdpa")
    if layout.endswith("packed_sdpa"):
        use_packed_sdpa(model)
    model.config.use_cache = False
    model.train()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _forward_backward(model, batch: dict[str, torch.Tensor]) -> None:
    from lightning_mem.logits import next_token_targets, score_tokens

    positions, targets = next_token_targets(batch["input_ids"], batch["labels"])
    scores = score_tokens(model, batch["input_ids"], batch.get("attention_mask"), positions, targets, chunk_size=512,
                          position_ids=batch.get("position_ids"))
    loss = -scores.logprobs.sum() / max(targets.numel(), 1)
    loss.backward()


def _step(model, optimizer, batch: dict[str, torch.Tensor]) -> None:
    _forward_backward(model, batch)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def timed(layout: str, batches: list[dict[str, torch.Tensor]]) -> tuple[float, int]:
    """(seconds of forward and backward, real tokens) over the micro-batches after the warm-up. The
    optimizer steps untimed: a layout with shorter micro-batches would otherwise pay more steps for
    the same tokens, which gradient accumulation does not."""
    model, optimizer = _model(layout)
    seconds, tokens = 0.0, 0
    for index, batch in enumerate(batches):
        start = time.perf_counter()
        _forward_backward(model, batch)
        elapsed = time.perf_counter() - start
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if index >= WARMUP:
            seconds += elapsed
            tokens += real_tokens(batch)
    return seconds, tokens


def peak_bytes(layout: str, batches: list[dict[str, torch.Tensor]]) -> int:
    """The largest tensor bytes a micro-batch's forward and backward keep alive at once (weights and
    optimizer state excluded: they are the same for every layout)."""
    from lightning_mem.estimate.tracker import MemoryLedger, TrackingMode

    model, optimizer = _model(layout)
    _step(model, optimizer, batches[0])  # AdamW's state exists before the measured steps
    peak = 0
    for batch in batches[:WARMUP]:
        ledger = MemoryLedger({model.config.vocab_size})
        with TrackingMode(ledger):
            _step(model, optimizer, batch)
        peak = max(peak, ledger.peak_bytes)
    return peak


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=4000)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=4096, help="the token budget of a micro-batch")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=24, help="micro-batches per layout and round, warm-up included")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    from benchmarks.data_scale import generate

    with tempfile.TemporaryDirectory(prefix="packing_bench_") as tmp:
        data = Path(tmp) / "chat.jsonl"
        generate(args.rows, data)
        batches = {layout: micro_batches(data, layout, args.steps, args.max_length, args.max_tokens) for layout in LAYOUTS}
    rows = {}
    for layout, bs in batches.items():
        rows[layout] = {
            "padding_efficiency": sum(real_tokens(b) for b in bs) / sum(b["input_ids"].numel() for b in bs),
            "real_tokens_per_micro_batch": statistics.mean(real_tokens(b) for b in bs),
            "rows_per_micro_batch": statistics.mean(b["input_ids"].shape[0] for b in bs),
            "examples_per_micro_batch": statistics.mean(examples(b) for b in bs),
            "peak_step_bytes": peak_bytes(layout, bs),
            "rates": [],
        }
    for round_ in range(args.rounds):
        for layout in LAYOUTS:
            seconds, tokens = timed(layout, batches[layout])
            rows[layout]["rates"].append(tokens / seconds)
        print(f"round {round_ + 1}/{args.rounds}: " + ", ".join(
            f"{layout} {statistics.median(rows[layout]['rates']):.0f} tok/s" for layout in LAYOUTS), file=sys.stderr, flush=True)
    for row in rows.values():
        row["tokens_per_s"] = statistics.median(row["rates"])
    base = rows["padded, sorted"]["tokens_per_s"]
    if args.json:
        print(json.dumps({"threads": torch.get_num_threads(), **vars(args), "layouts": rows}))
    else:
        print("| layout | real tokens / padded tokens | rows x examples per micro-batch | real tokens/s (median) | vs padded, sorted | peak step MiB |")
        print("|---|---|---|---|---|---|")
        for layout, row in rows.items():
            print(f"| {layout} | {row['padding_efficiency']:.3f} | {row['rows_per_micro_batch']:.1f} x {row['examples_per_micro_batch']:.1f} | "
                  f"{row['tokens_per_s']:.0f} | {row['tokens_per_s'] / base:.2f}x | {row['peak_step_bytes'] / 2**20:.1f} |")
    return rows


if __name__ == "__main__":
    main()
