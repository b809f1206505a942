"""SFT step time: the recipe under Lightning's Trainer against a bare PyTorch loop over the same batches.

    python benchmarks/step_time.py                       # tiny config, 3 rounds of 40 steps each, interleaved
    python benchmarks/step_time.py --rounds 5 --steps 60 --threads 1
    python benchmarks/step_time.py --json                # one JSON line (for comparing two checkouts)
    # the GPU benchmark's shape, smaller (benchmarks/gpu/step_time.py runs it on CUDA):
    python benchmarks/step_time.py --model assets/hub/Qwen/Qwen2.5-0.5B-Instruct --rows 2 --tokens 128 \
        --precision bf16-mixed --rounds 1 --steps 8 --options none,compile

Both sides train the same model from the same seed on the same micro-batches, drawn once and
replayed. By default those are the SFT datamodule's token-budget batches of
``data/arithmetic/train.jsonl`` on the tiny Llama; with ``--model`` (a config folder, random init)
they are ``--rows`` synthetic rows of exactly ``--tokens`` tokens whose second half is the
completion (the loss's tokens). The recipe is ``recipes.sft.SFTModule`` fitted by a Lightning
``Trainer`` (its ``training_step``, Lightning's backward, clipping and optimizer step, and the
recipe's gradient lifetime); the bare loop is the same model with the same loss (the chunked logits
path, or ``--bare-loss hf``: the model's own full-logits loss), ``clip_grad_norm_``, ``AdamW.step``
and ``zero_grad(set_to_none=True)``, under the same autocast. Rounds alternate between the two, so
load from other jobs falls on both alike; each round's first steps are a warm-up and are not
timed. The figure is the ratio of the medians; absolute times depend on the machine and its load.

``--options`` runs the recipe once more per option set, each against the plain bare loop. A set is
``none`` or parts joined by ``+``: ``compile`` (the :class:`~lightning_mem.callbacks.CompileBlocks`
callback), ``liger`` (:class:`~lightning_mem.callbacks.LigerKernels`, CUDA only), ``liger:<kernel>``
(Liger's ``rms_norm``, ``swiglu`` or ``rope`` alone; several such parts: those kernels), and
``no-shared-casts`` (the recipe without its :class:`~lightning_mem.callbacks.SharedCasts`, to time
what that callback costs or saves). Compile time falls in the warm-up steps.

To compare two versions of the recipe, run this file with ``--code <checkout>`` for each (rounds
alternated by the caller): the recipe and the library are imported from that checkout, and the
JSON line has the median recipe and bare step times.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
WARMUP = 5
OPTIONS = ("none", "compile", "liger", "compile+liger")  # the usual sets; parts combine freely (option_parts)
PARTS = ("compile", "liger", "liger:rms_norm", "liger:swiglu", "liger:rope", "no-shared-casts")
AUTOCAST = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


@dataclass
class Setup:
    """What both sides run: the model folder, the device, the precision and the optimizer."""

    model: str = str(ROOT / "assets/tiny-llama")
    device: str = "cpu"
    precision: str = "32-true"
    fused: bool = False  # torch's fused AdamW (CUDA and CPU)
    lr: float = 1e-3
    #: The recipe's ``model.logits_chunk_size`` and the chunked bare loop's; None: the recipe's default
    #: (and an unchunked bare loop).
    chunk_size: int | None = 512
    warmup: int = WARMUP
    sync: bool = False  # torch.cuda.synchronize() before each clock reading

    def optimizer(self, params: Any) -> torch.optim.Optimizer:
        # Not fused: torch's default (foreach on CUDA, a loop over parameters on a CPU).
        return torch.optim.AdamW(params, lr=self.lr, **({"fused": True} if self.fused else {}))

    def autocast(self) -> contextlib.AbstractContextManager:
        dtype = AUTOCAST.get(self.precision)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device, dtype=dtype)

    def now(self) -> float:
        if self.sync:
            torch.cuda.synchronize()
        return time.perf_counter()


@dataclass
class Steps:
    """Seconds per optimizer step after the warm-up, and the peak allocated bytes of the timed steps
    (CUDA only; None elsewhere)."""

    seconds: list[float] = field(default_factory=list)
    peak_bytes: int | None = None


def batches(count: int) -> list[dict[str, torch.Tensor]]:
    """The tiny config's token-budget micro-batches of the arithmetic data, ``count`` of them."""
    from lightning_mem.data import SFTDataModule

    data = SFTDataModule(train_file=str(ROOT / "data/arithmetic/train.jsonl"), tokenizer=str(ROOT / "assets/tiny-llama"),
                         max_length=64, max_tokens_per_batch=1024)
    data.setup("fit")
    out = []
    while len(out) < count:
        out.extend(data.train_dataloader())
    return out[:count]


def synthetic_batches(count: int, rows: int, tokens: int, vocab_size: int, *, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``count`` batches of ``rows`` x ``tokens`` random token ids; the loss is on each row's second half."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(3, vocab_size, (rows, tokens), generator=generator)
        labels = ids.clone()
        labels[:, : tokens // 2] = -100  # the prompt: no loss
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})
    return out


def vocab_size_of(model: str) -> int:
    return int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])


def option_parts(options: str) -> list[str]:
    """The parts of one option set (``none``: no part), each one of :data:`PARTS`."""
    parts = [] if options == "none" else options.split("+")
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise ValueError(f"unknown options {unknown} in {options!r}; a set is 'none' or parts of {PARTS} joined by '+'")
    if "liger" in parts and any(part.startswith("liger:") for part in parts):
        raise ValueError(f"{options!r}: 'liger' is every Liger kernel; name 'liger:<kernel>' parts alone to pick some")
    return parts


def option_sets(text: str) -> list[str]:
    """``--options``: comma-separated option sets, each checked by :func:`option_parts`."""
    sets = text.split(",")
    for options in sets:
        option_parts(options)
    return sets


def _callbacks(options: str) -> list[Any]:
    from lightning_mem.callbacks import CompileBlocks, LigerKernels
    from lightning_mem.liger import KERNELS

    parts = option_parts(options)
    kernels = KERNELS if "liger" in parts else [part.split(":", 1)[1] for part in parts if part.startswith("liger:")]
    liger = [LigerKernels(**{name: name in kernels for name in KERNELS})] if kernels else []
    # Liger patches the modules first; the compiled forwards then trace Liger's kernels.
    return liger + ([CompileBlocks()] if "compile" in parts else [])


def _recipe_class(options: str) -> type:
    """The SFT recipe's LightningModule, without its SharedCasts callback for ``no-shared-casts``."""
    from recipes.sft import SFTModule

    if "no-shared-casts" not in option_parts(options):
        return SFTModule
    from lightning_mem.callbacks.shared_casts import SharedCasts

    class WithoutSharedCasts(SFTModule):
        def configure_callbacks(self) -> list[Any]:
            return [c for c in super().configure_callbacks() if not isinstance(c, SharedCasts)]

    return WithoutSharedCasts


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _peak_since_reset(setup: Setup) -> int | None:
    return torch.cuda.max_memory_allocated() if setup.device == "cuda" else None


def recipe_steps(data: list[dict[str, torch.Tensor]], setup: Setup | None = None, options: str = "none") -> Steps:
    """The SFT recipe under Lightning, one time per batch after the warm-up."""
    from lightning.pytorch import Callback, Trainer, seed_everything
    from torch.utils.data import DataLoader

    from lightning_mem.data.sft import with_targets

    setup = setup or Setup()
    recipe = _recipe_class(options)
    # What the recipe's datamodule adds to each batch on the host (its targets and their count), so
    # that the step finds them with the batch, as in a run, and not on the device (a host sync).
    data = [b if "target_positions" in b else with_targets(b) for b in data]

    class Clock(Callback):
        def __init__(self) -> None:
            self.marks: list[float] = []
            self.peak: int | None = None

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, index: int) -> None:
            self.marks.append(setup.now())
            if index == setup.warmup and setup.device == "cuda":
                torch.cuda.reset_peak_memory_stats()

        def on_train_end(self, *args: object) -> None:
            self.marks.append(setup.now())
            self.peak = _peak_since_reset(setup)

    if "compile" in options:  # graphs compiled for another model would make this one's shapes dynamic
        torch._dynamo.reset()
    seed_everything(0, verbose=False)
    chunking = {} if setup.chunk_size is None else {"logits_chunk_size": setup.chunk_size}
    module = recipe(setup.model, optimizer=setup.optimizer, export_dir=None, **chunking)
    clock = Clock()
    trainer = Trainer(accelerator=setup.device, devices=1, precision=setup.precision, max_steps=len(data),
                      gradient_clip_val=1.0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, callbacks=[clock, *_callbacks(options)])
    trainer.fit(module, train_dataloaders=DataLoader(data, batch_size=None, collate_fn=lambda b: b))
    steps = [b - a for a, b in zip(clock.marks, clock.marks[1:])]
    del trainer, module
    _free()
    return Steps(steps[setup.warmup:], clock.peak)


def _chunked_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], chunk_size: int | None) -> torch.Tensor:
    from lightning_mem.logits import next_token_targets, score_tokens

    positions, targets = next_token_targets(batch["input_ids"], batch["labels"])
    scores = score_tokens(model, batch["input_ids"], batch["attention_mask"], positions, targets, chunk_size=chunk_size)
    return -scores.logprobs.sum() / max(targets.numel(), 1)


def _hf_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], chunk_size: int | None) -> torch.Tensor:
    return model(**batch).loss  # full [tokens, vocab] logits: what a plain Hugging Face loop does


LOSSES: dict[str, Callable[..., torch.Tensor]] = {"chunked": _chunked_loss, "hf": _hf_loss}


def bare_steps(data: list[dict[str, torch.Tensor]], setup: Setup | None = None, loss: str = "chunked") -> Steps:
    """A plain PyTorch loop doing the same work, one time per batch after the warm-up."""
    from lightning.pytorch import seed_everything

    from lightning_mem.models import load_causal_lm

    setup = setup or Setup()
    loss_of = LOSSES[loss]
    seed_everything(0, verbose=False)
    # The trained weights in fp32 under *-mixed, as the recipe keeps them (lightning_mem.dtypes).
    dtype = torch.bfloat16 if setup.precision == "bf16-true" else torch.float32
    with torch.device(setup.device):  # built on the device, as Lightning builds the recipe's (configure_model)
        model = load_causal_lm(setup.model, dtype=dtype)
    model.config.use_cache = False
    model.train()
    optimizer = setup.optimizer(model.parameters())
    marks, peak = [], None
    for index, batch in enumerate(data):
        marks.append(setup.now())
        if index == setup.warmup and setup.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        batch = {k: v.to(setup.device, non_blocking=True) for k, v in batch.items()}
        with setup.autocast():
            value = loss_of(model, batch, setup.chunk_size)
        value.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    marks.append(setup.now())
    peak = _peak_since_reset(setup)
    del model, optimizer
    _free()
    steps = [b - a for a, b in zip(marks, marks[1:])]
    return Steps(steps[setup.warmup:], peak)


def tokens_per_step(data: list[dict[str, torch.Tensor]]) -> float:
    return statistics.mean(int(b["attention_mask"].numel()) for b in data)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40, help="steps per round, warm-up included")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--json", action="store_true", help="print one JSON line instead of a table")
    parser.add_argument("--code", default=str(ROOT), help="the checkout whose recipe and library run (default: this one)")
    parser.add_argument("--model", default=None, help="a model config folder (random init) and synthetic rows"
                                                      " instead of the tiny config's data")
    parser.add_argument("--rows", type=int, default=8, help="with --model: rows per batch")
    parser.add_argument("--tokens", type=int, default=1024, help="with --model: tokens per row")
    parser.add_argument("--precision", default="32-true", help="Lightning precision (bf16-mixed: autocast over fp32 weights)")
    parser.add_argument("--fused", action="store_true", help="fused AdamW instead of torch's default")
    parser.add_argument("--bare-loss", choices=sorted(LOSSES), default="chunked")
    parser.add_argument("--options", default="none", help=f"comma-separated option sets for the recipe, such as {OPTIONS}"
                                                         f" (a set: 'none' or parts of {PARTS} joined by '+')")
    parser.add_argument("--chunk-size", type=int, default=Setup.chunk_size,
                        help="scored tokens per logits chunk, the recipe's and the chunked bare loop's (0: unchunked)")
    return parser


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        options = option_sets(args.options)
    except ValueError as err:
        parser.error(f"--options: {err}")
    sys.path.insert(0, args.code)
    if args.threads:
        torch.set_num_threads(args.threads)
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    setup = Setup(precision=args.precision, fused=args.fused, warmup=min(WARMUP, args.steps // 2),
                  chunk_size=args.chunk_size)
    if args.model:
        setup.model = args.model
        data = synthetic_batches(args.steps, args.rows, args.tokens, vocab_size_of(args.model))
    else:
        data = batches(args.steps)
    recipe: dict[str, list[float]] = {name: [] for name in options}
    bare: list[float] = []
    for index in range(args.rounds):
        for name in options:
            recipe[name] += recipe_steps(data, setup, name).seconds
        bare += bare_steps(data, setup, args.bare_loss).seconds
        if not args.json:
            print(f"round {index + 1}/{args.rounds}: " + ", ".join(
                f"recipe[{name}] {statistics.median(recipe[name]) * 1e3:.1f} ms" for name in options)
                + f", bare {statistics.median(bare) * 1e3:.1f} ms", file=sys.stderr, flush=True)
    first = options[0]
    result = {"recipe_ms": statistics.median(recipe[first]) * 1e3, "bare_ms": statistics.median(bare) * 1e3,
              "steps_timed": len(recipe[first]), "threads": torch.get_num_threads(), "tokens_per_step": tokens_per_step(data)}
    result["ratio"] = result["recipe_ms"] / result["bare_ms"]
    for name in options[1:]:
        result[f"recipe_{name}_ms"] = statistics.median(recipe[name]) * 1e3
        result[f"ratio_{name}"] = result[f"recipe_{name}_ms"] / result["bare_ms"]
    if args.json:
        print(json.dumps(result))
    else:
        what = f"{Path(setup.model).name}, {args.precision}, logits chunk {args.chunk_size or 'none'}"
        for name in options:
            ms = statistics.median(recipe[name]) * 1e3
            print(f"| SFT step, {what}, {result['tokens_per_step']:.0f} padded tokens, options {name} | recipe {ms:.1f} ms"
                  f" | bare loop {result['bare_ms']:.1f} ms | ratio **{ms / result['bare_ms']:.3f}** |")
    return result


if __name__ == "__main__":
    main()
