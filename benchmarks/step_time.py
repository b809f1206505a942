"""SFT step time: the recipe under Lightning's Trainer against a bare PyTorch loop over the same batches.

    python benchmarks/step_time.py                       # tiny config, 3 rounds of 40 steps each, interleaved
    python benchmarks/step_time.py --rounds 5 --steps 60 --threads 1
    python benchmarks/step_time.py --json                # one JSON line (for comparing two checkouts)

Both sides train the tiny Llama from the same seed on the same micro-batches (the SFT datamodule's
token-budget batches of ``data/arithmetic/train.jsonl``, drawn once and replayed): the recipe is
``recipes.sft.SFTModule`` fitted by a Lightning ``Trainer`` (its ``training_step``, Lightning's
backward, clipping and optimizer step, and the recipe's gradient lifetime), the bare loop is the
same model with the same loss (the chunked logits path), ``clip_grad_norm_``, ``AdamW.step`` and
``zero_grad(set_to_none=True)``. Rounds alternate between the two, so load from other jobs falls on
both alike; each round's first steps are a warm-up and are not timed. The figure is the ratio of
the medians; absolute times depend on the machine and its load.

To compare two versions of the recipe, run this file with ``--code <checkout>`` for each (rounds
alternated by the caller): the recipe and the library are imported from that checkout, and the
JSON line has the median recipe and bare step times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
WARMUP = 5


def batches(count: int) -> list[dict[str, torch.Tensor]]:
    from lightning_mem.data import SFTDataModule

    data = SFTDataModule(train_file=str(ROOT / "data/arithmetic/train.jsonl"), tokenizer=str(ROOT / "assets/tiny-llama"),
                         max_length=64, max_tokens_per_batch=1024)
    data.setup("fit")
    out = []
    while len(out) < count:
        out.extend(data.train_dataloader())
    return out[:count]


def recipe_steps(data: list[dict[str, torch.Tensor]]) -> list[float]:
    """Seconds per optimizer step of the SFT recipe under Lightning, one per batch after the warm-up."""
    from lightning.pytorch import Callback, Trainer, seed_everything
    from torch.utils.data import DataLoader

    from recipes.sft import SFTModule

    class Clock(Callback):
        def __init__(self) -> None:
            self.marks: list[float] = []

        def on_train_batch_start(self, *args: object) -> None:
            self.marks.append(time.perf_counter())

        def on_train_end(self, *args: object) -> None:
            self.marks.append(time.perf_counter())

    seed_everything(0, verbose=False)
    module = SFTModule(str(ROOT / "assets/tiny-llama"), optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
                       export_dir=None)
    clock = Clock()
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=len(data), gradient_clip_val=1.0, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, callbacks=[clock])
    trainer.fit(module, train_dataloaders=DataLoader(data, batch_size=None, collate_fn=lambda b: b))
    steps = [b - a for a, b in zip(clock.marks, clock.marks[1:])]
    return steps[WARMUP:]


def bare_steps(data: list[dict[str, torch.Tensor]]) -> list[float]:
    """Seconds per optimizer step of a plain PyTorch loop doing the same work."""
    from lightning.pytorch import seed_everything

    from lightning_mem.logits import next_token_targets, score_tokens
    from lightning_mem.models import load_causal_lm

    seed_everything(0, verbose=False)
    model = load_causal_lm(str(ROOT / "assets/tiny-llama"))
    model.config.use_cache = False
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    marks = []
    for batch in data:
        marks.append(time.perf_counter())
        positions, targets = next_token_targets(batch["input_ids"], batch["labels"])
        scores = score_tokens(model, batch["input_ids"], batch["attention_mask"], positions, targets, chunk_size=512)
        loss = -scores.logprobs.sum() / max(targets.numel(), 1)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    marks.append(time.perf_counter())
    steps = [b - a for a, b in zip(marks, marks[1:])]
    return steps[WARMUP:]


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40, help="steps per round, warm-up included")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--json", action="store_true", help="print one JSON line instead of a table")
    parser.add_argument("--code", default=str(ROOT), help="the checkout whose recipe and library run (default: this one)")
    args = parser.parse_args(argv)
    sys.path.insert(0, args.code)
    if args.threads:
        torch.set_num_threads(args.threads)
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    data = batches(args.steps)
    recipe, bare = [], []
    for index in range(args.rounds):
        recipe += recipe_steps(data)
        bare += bare_steps(data)
        if not args.json:
            print(f"round {index + 1}/{args.rounds}: recipe {statistics.median(recipe) * 1e3:.1f} ms, "
                  f"bare {statistics.median(bare) * 1e3:.1f} ms", file=sys.stderr, flush=True)
    result = {"recipe_ms": statistics.median(recipe) * 1e3, "bare_ms": statistics.median(bare) * 1e3,
              "steps_timed": len(recipe), "threads": torch.get_num_threads(),
              "tokens_per_step": statistics.mean(int(b["attention_mask"].numel()) for b in data)}
    result["ratio"] = result["recipe_ms"] / result["bare_ms"]
    if args.json:
        print(json.dumps(result))
    else:
        print(f"| SFT step, tiny model, {result['tokens_per_step']:.0f} padded tokens | recipe {result['recipe_ms']:.1f} ms"
              f" | bare loop {result['bare_ms']:.1f} ms | ratio **{result['ratio']:.3f}** |")
    return result


if __name__ == "__main__":
    main()
