"""GPU step time: the SFT recipe's step against a bare PyTorch loop on the same batches, at the
Qwen2.5-0.5B and 1.5B architectures, with and without the speed options.

    python -m benchmarks.gpu.step_time --out runs/gpu                   # what benchmarks/gpu/run.sh runs
    python -m benchmarks.gpu.step_time --options none                   # no compile, no Liger
    python -m benchmarks.gpu.step_time --device cpu --models assets/tiny-llama \
        --rows 2 --tokens 64 --steps 4 --warmup 2                       # its CPU side (tests/test_gpu_step_time.py)

The work is issue #37's: random init from ``assets/hub/<model>/config.json`` (no weights on a
machine without network), ``--rows`` rows of exactly ``--tokens`` tokens a step with the loss on
each row's second half (the completion), bf16 autocast over fp32 weights (``bf16-mixed``), AdamW
(fused unless ``--no-fused``), gradient clipping at 1.0, no activation checkpointing. The bare loop
is the model's own Hugging Face loss (full logits) unless ``--bare-loss chunked``. Both sides come
from ``benchmarks/step_time.py`` (the CPU benchmark), here with CUDA synchronised before each clock
reading; a figure is the median step after ``--warmup`` steps, tokens/s counts every token of the
batch, and the peak is ``torch.cuda.max_memory_allocated`` over the timed steps.

Each option set (``compile``: ``CompileBlocks``; ``liger``: ``LigerKernels``, which needs the
``liger-kernel`` wheel in ``.whl/``; ``compile+liger``; one Liger kernel alone, ``liger:rms_norm``;
the recipe without ``SharedCasts``, ``no-shared-casts``: ``benchmarks/step_time.py`` says the
grammar) is one more recipe run beside the same bare loop. Liger's runs come after every other run
(``LigerKernels`` puts back what Liger rebinds for the process when its fit ends; last, a fault
there cannot reach the others). Rows that cannot run (no Liger, an out-of-memory) say why and the
rest go on.

    python -m benchmarks.gpu.step_time --models Qwen/Qwen2.5-0.5B-Instruct \
        --options none,no-shared-casts,liger,liger:rms_norm,liger:swiglu,liger:rope   # which part costs what

Writes ``gpu_step_time.json``, ``gpu_step_time.csv`` and ``gpu_step_time.md`` (the rows for
docs/benchmarks.md) under ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import logging
import os
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

from benchmarks import step_time as cpu_bench
from lightning_mem.assets import HUB_ASSETS

ROOT = Path(__file__).resolve().parents[2]
MODELS = ("Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-1.5B")
GiB = 1 << 30
COLUMNS = ("model", "run", "options", "median_ms", "tokens_per_s", "peak_gib", "time_ratio", "peak_ratio", "steps",
           "optimizer", "outcome")
TABLE_HEAD = ("| model | run | options | median step (ms) | tokens/s | peak allocated (GiB) | time / bare loop"
              " | peak / bare loop | outcome |\n|---|---|---|---|---|---|---|---|---|")


def model_folder(name: str) -> str:
    """A shipped architecture (``Qwen/Qwen2.5-0.5B-Instruct``: ``assets/hub``) or any config folder."""
    path = Path(name)
    if (path / "config.json").is_file():
        return str(path)
    if (HUB_ASSETS / name / "config.json").is_file():
        return str(HUB_ASSETS / name)
    raise FileNotFoundError(f"--models: {name!r} is neither a config folder nor one of assets/hub's")


def option_order(options: list[str]) -> list[str]:
    """The option sets with every Liger one last (Liger patches model classes process-wide)."""
    return sorted(options, key=lambda name: "liger" in name)


def liger_missing(device: str) -> str | None:
    """Why Liger cannot run here, or None."""
    from lightning_mem.liger import check_liger

    try:
        check_liger(device)
    except ValueError as err:
        return str(err)
    return None


def _row(model: str, run: str, options: str, steps: cpu_bench.Steps | None, tokens: int, optimizer: str,
         outcome: str = "ran") -> dict[str, Any]:
    row: dict[str, Any] = dict(model=model, run=run, options=options, median_ms=None, tokens_per_s=None, peak_gib=None,
                               time_ratio=None, peak_ratio=None, steps=0, optimizer=optimizer, outcome=outcome)
    if steps is not None and steps.seconds:
        median = statistics.median(steps.seconds)
        row.update(median_ms=median * 1e3, tokens_per_s=tokens / median, steps=len(steps.seconds),
                   peak_gib=None if steps.peak_bytes is None else steps.peak_bytes / GiB)
    return row


def _attempt(run: Any) -> tuple[cpu_bench.Steps | None, str]:
    try:
        return run(), "ran"
    except Exception as err:  # an out-of-memory or a refusal costs this row only
        traceback.print_exc(file=sys.stderr)
        cpu_bench._free()
        text = " ".join(str(err).split())
        return None, f"{type(err).__name__}: {text[:160]}"


def measure(models: list[str], options: list[str], *, rows: int, tokens: int, steps: int, warmup: int, device: str,
            precision: str, fused: bool, bare_loss: str, on_row: Any = None) -> list[dict[str, Any]]:
    """Every row: per model the bare loop, then the recipe with each option set. ``on_row(rows)``
    after each row (the files are rewritten, so a run stopped by a time limit keeps what it did)."""
    results: list[dict[str, Any]] = []
    no_liger = liger_missing(device) if any("liger" in o for o in options) else None
    data_of = {}
    for name in models:
        folder = model_folder(name)
        data = cpu_bench.synthetic_batches(warmup + steps, rows, tokens, cpu_bench.vocab_size_of(folder))
        data_of[name] = (folder, [{k: v.to(device) for k, v in b.items()} for b in data])
    # chunk_size None: the recipe's own logits chunking, whatever its default is.
    setup = cpu_bench.Setup(device=device, precision=precision, fused=fused, warmup=warmup, sync=device == "cuda",
                            lr=1e-5, chunk_size=None)
    optimizer = "AdamW fused" if fused else "AdamW (torch's default)"
    bare: dict[str, dict[str, Any]] = {}
    for option in option_order(options):
        for name in models:
            folder, data = data_of[name]
            setup.model = folder
            if name not in bare:
                steps_run, outcome = _attempt(lambda: cpu_bench.bare_steps(data, setup, bare_loss))
                bare[name] = _row(name, f"bare loop ({bare_loss} loss)", "none", steps_run, rows * tokens, optimizer, outcome)
                results.append(bare[name])
                print(_line(bare[name]), flush=True)
                if on_row:
                    on_row(results)
            if "liger" in option and no_liger:
                row = _row(name, "recipe", option, None, rows * tokens, optimizer, f"skipped: {no_liger}")
            else:
                steps_run, outcome = _attempt(lambda: cpu_bench.recipe_steps(data, setup, option))
                row = _row(name, "recipe", option, steps_run, rows * tokens, optimizer, outcome)
            base = bare[name]
            if row["median_ms"] and base["median_ms"]:
                row["time_ratio"] = row["median_ms"] / base["median_ms"]
            if row["peak_gib"] and base["peak_gib"]:
                row["peak_ratio"] = row["peak_gib"] / base["peak_gib"]
            results.append(row)
            print(_line(row), flush=True)
            if on_row:
                on_row(results)
    order = {name: i for i, name in enumerate(models)}
    return sorted(results, key=lambda r: (order[r["model"]], r["run"] == "recipe"))  # per model, the bare loop first


def fmt(value: Any, spec: str) -> str:
    """``value`` formatted by ``spec``, or ``n/a`` for a figure a failed run did not give."""
    return "n/a" if value is None else format(value, spec)


def _line(row: dict[str, Any]) -> str:
    return (f"| {row['model']} | {row['run']} | {row['options']} | {fmt(row['median_ms'], '.1f')}"
            f" | {fmt(row['tokens_per_s'], ',.0f')} | {fmt(row['peak_gib'], '.2f')} | {fmt(row['time_ratio'], '.3f')}"
            f" | {fmt(row['peak_ratio'], '.3f')} | {row['outcome']} |")


def markdown(results: list[dict[str, Any]], *, date: str, device: str, command: str, what: str) -> str:
    return "\n".join([f"{date}, {device}, `{command}`; {what}", "", TABLE_HEAD, *map(_line, results), ""])


def write(results: list[dict[str, Any]], out: Path, text: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_step_time.json").write_text(json.dumps(results, indent=1))
    with (out / "gpu_step_time.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(results)
    (out / "gpu_step_time.md").write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu.step_time", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "runs" / "gpu"))
    parser.add_argument("--models", nargs="+", default=list(MODELS), help="assets/hub names or config folders")
    parser.add_argument("--options", default="none,compile,liger",
                        help=f"comma-separated option sets of the recipe runs, such as {cpu_bench.OPTIONS} (a set:"
                             f" 'none' or parts of {cpu_bench.PARTS} joined by '+')")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--no-fused", dest="fused", action="store_false", help="torch's default AdamW, not the fused one")
    parser.add_argument("--bare-loss", choices=sorted(cpu_bench.LOSSES), default="hf")
    args = parser.parse_args(argv)
    try:
        options = cpu_bench.option_sets(args.options)
    except ValueError as err:
        parser.error(f"--options: {err}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here (the CPU side: --device cpu)")
    for name in args.models:
        try:
            model_folder(name)
        except FileNotFoundError as err:
            parser.error(str(err))
    # Quiet while it runs, and only then: the tests call main() in their own process.
    lightning_log = logging.getLogger("lightning.pytorch")
    level = lightning_log.level
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore")
        lightning_log.setLevel(logging.ERROR)
        try:
            return _run(args, options, argv)
        finally:
            lightning_log.setLevel(level)


def _run(args: argparse.Namespace, options: list[str], argv: list[str] | None) -> int:
    start = time.perf_counter()
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else f"{args.device} ({os.cpu_count()} cores)"
    what = (f"{args.rows} x {args.tokens} tokens a step, loss on the second half, {args.precision}, clip 1.0,"
            f" {'fused AdamW' if args.fused else 'AdamW'}, median of {args.steps} steps after {args.warmup};"
            f" torch {torch.__version__}")
    command = "python -m benchmarks.gpu.step_time " + " ".join(argv if argv is not None else sys.argv[1:])

    def save(rows: list[dict[str, Any]]) -> str:
        text = markdown(rows, date=datetime.date.today().isoformat(), device=device, command=command, what=what)
        write(rows, args.out, text)
        return text

    results = measure(args.models, options, rows=args.rows, tokens=args.tokens, steps=args.steps, warmup=args.warmup,
                      device=args.device, precision=args.precision, fused=args.fused, bare_loss=args.bare_loss,
                      on_row=save)
    print(save(results))
    print(f"gpu step time: {len(results)} rows in {time.perf_counter() - start:.0f} s -> {args.out}/gpu_step_time.*")
    return 0


if __name__ == "__main__":
    sys.exit(main())
