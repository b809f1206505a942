"""One SFT step of a real architecture on CPU: the recipe's tracked peak beside its floor, a plain
PyTorch loop over the same batches, and the memory estimate.

    python benchmarks/real_architecture_memory.py            # Qwen2.5-0.5B-Instruct, fp32 AdamW, 4 x 256 tokens
    python benchmarks/real_architecture_memory.py --model assets/hub/Qwen/Qwen2.5-0.5B-Instruct --rows 4 --length 256

The model is the architecture's shipped ``config.json`` (which says ``torch_dtype: bfloat16``, as every
real checkpoint does) with random weights and the tiny tokenizer; the run is ``configs/sft/tiny_cpu.yaml``
(``32-true``, AdamW, no checkpointing) pointed at it, on rows that fill every micro-batch. Three
measurements, all tracked tensor bytes (``lightning_mem.estimate.tracker``) on real CPU tensors except
the estimate:

- the recipe: ``lightning_mem.estimate.measure_fit`` (the recipe's CLI and ``trainer.fit``; the second
  optimizer step is measured), and the process's peak RSS;
- a plain loop: the same model, loss (the chunked logits path), AdamW, clipping and
  ``zero_grad(set_to_none=True)`` after the step, on the same batches;
- the floor: weights + gradients + optimizer state + the activations the forward leaves for backward
  (counted in the plain loop at the end of its forward): what no schedule of this step can avoid;
- the estimate: ``lightning_mem.estimate.estimate`` of the same config and overrides, on fake tensors.

It prints one markdown row for docs/benchmarks.md. Needs about 12 GB of host memory for the 0.5B model.
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9


def model_folder(config_dir: Path, into: Path) -> Path:
    """The architecture's config.json with the tiny tokenizer: random weights, real shapes."""
    into.mkdir(parents=True, exist_ok=True)
    shutil.copy(config_dir / "config.json", into / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (ROOT / "assets/tiny-llama" / name).is_file():
            shutil.copy(ROOT / "assets/tiny-llama" / name, into / name)
    return into


def plain_loop(folder: Path, batches: list[dict[str, torch.Tensor]]) -> tuple[int, dict[str, int], int]:
    """Tracked peak, its breakdown, and the activations alive at the end of the last forward."""
    from lightning_mem.estimate.tracker import MemoryLedger, TrackingMode
    from lightning_mem.logits import next_token_targets, score_tokens
    from lightning_mem.models import load_causal_lm

    ledger = MemoryLedger({json.loads((folder / "config.json").read_text())["vocab_size"]})
    with TrackingMode(ledger):
        model = load_causal_lm(str(folder), dtype="float32")
        model.config.use_cache = False
        model.train()
        for p in model.parameters():
            ledger.retag(p, "weights")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        saved = 0
        for index, batch in enumerate(batches):
            if index == len(batches) - 1:
                ledger.reset_peak()
            positions, targets = next_token_targets(batch["input_ids"], batch["labels"])
            scores = score_tokens(model, batch["input_ids"], batch["attention_mask"], positions, targets, chunk_size=512)
            loss = -scores.logprobs.sum() / max(targets.numel(), 1)
            saved = ledger.totals["activations"] + ledger.totals["logits"]
            loss.backward()
            for p in model.parameters():
                ledger.retag(p.grad, "gradients")
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            for state in optimizer.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        ledger.retag(value, "optimizer_state")
            del loss, scores
    return ledger.peak_bytes, dict(ledger.peak_breakdown), saved


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(ROOT / "assets/hub/Qwen/Qwen2.5-0.5B-Instruct"))
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--dtype", default=None, help="model.dtype (default: unset, the trainer's precision decides)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    from lightning_mem.data import SFTDataModule
    from lightning_mem.estimate import estimate, measure_fit

    with tempfile.TemporaryDirectory() as tmp:
        folder = model_folder(Path(args.model), Path(tmp) / "model")
        rows = Path(tmp) / "rows.jsonl"
        rows.write_text("".join(json.dumps({"prompt": "1+1", "completion": "x" * (2 * args.length)}) + "\n"
                                for _ in range(4 * args.rows)))
        overrides = [f"--model.name_or_path={folder}", f"--data.train_file={rows}", "--data.val_file=null",
                     f"--data.max_length={args.length}", f"--data.max_tokens_per_batch={args.rows * args.length}",
                     "--model.optimizer.init_args.lr=1e-5", "--model.lr_scheduler.init_args.warmup_steps=1",
                     *([f"--model.dtype={args.dtype}"] if args.dtype else [])]
        config = ROOT / "configs/sft/tiny_cpu.yaml"
        est = estimate(config, overrides).phases[0]
        print(f"estimate: {est.device_peak_bytes / GB:.3f} GB {est.device_breakdown_bytes}", file=sys.stderr, flush=True)
        (fit,), = measure_fit(config, overrides, steps=2)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print(f"fit: {fit.device_peak_bytes / GB:.3f} GB {fit.device_breakdown_bytes}; max RSS {rss / GB:.2f} GB",
              file=sys.stderr, flush=True)
        data = SFTDataModule(train_file=str(rows), tokenizer=str(folder), max_length=args.length,
                             max_tokens_per_batch=args.rows * args.length)
        data.setup("fit")
        batches = [b for b, _ in zip(data.train_dataloader(), range(2))]
        plain_peak, plain, saved = plain_loop(folder, batches)
    b = fit.device_breakdown_bytes
    params = b["weights"]
    floor = params + params + b["optimizer_state"] + saved  # weights, all gradients, state, saved activations
    print(f"| {Path(args.model).name}, random init, fp32 AdamW, {args.rows} x {args.length} tokens | recipe tracked peak "
          f"**{fit.device_peak_bytes / GB:.2f} GB** (weights {b['weights'] / GB:.2f}, gradients {b['gradients'] / GB:.2f}, "
          f"optimizer {b['optimizer_state'] / GB:.2f}, activations {(b['activations'] + b['logits']) / GB:.2f}); "
          f"floor {floor / GB:.2f} GB (peak / floor {fit.device_peak_bytes / floor:.3f}); plain loop "
          f"{plain_peak / GB:.2f} GB (recipe / plain {fit.device_peak_bytes / plain_peak:.3f}); estimate "
          f"{est.device_peak_bytes / GB:.2f} GB (estimate / recipe {est.device_peak_bytes / fit.device_peak_bytes:.3f}); "
          f"process max RSS {rss / GB:.1f} GB |")


if __name__ == "__main__":
    main()
