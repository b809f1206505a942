"""The memory estimate against published GPU peak-memory figures, for setups the configs can express.

    python benchmarks/published_figures.py                 # every setup: a markdown table on stdout
    python benchmarks/published_figures.py --write         # ... and into docs/will_it_fit.md
    python benchmarks/published_figures.py --only litgpt   # setups whose name contains this

Each setup is one of the shipped configs plus recipe CLI overrides that make it the published
run as far as the recipes can say it (model, precision, LoRA, quantization, optimizer, micro-batch
shape, checkpointing); what they cannot say is written beside it. Its estimate is
``lightning_mem.estimate.estimate`` (fake tensors, tracked tensor bytes, the largest phase), set
beside the published peak (``torch.cuda.max_memory_allocated`` in every source used here, which
counts tensors too, not the CUDA context). This script is the table's only source: the doc's
table is between the markers below and is rewritten with ``--write``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere, no install needed

DOC = ROOT / "docs" / "will_it_fit.md"
BEGIN = "<!-- published-figures:begin (written by benchmarks/published_figures.py; do not edit by hand) -->"
END = "<!-- published-figures:end -->"
GB, GiB = 10**9, 1 << 30

LITGPT = ("LitGPT resource tables, https://github.com/Lightning-AI/litgpt/blob/main/tutorials/resource-tables.md"
          " (LitGPT commit 8641822, 1x A100 40GB), table \"Finetuning with LoRA on 1 GPU\", row")
TORCHTUNE = ("torchtune README, https://github.com/pytorch/torchtune/blob/30b8519e8/README.md, table \"Memory and"
             " training speed\" (batch 2, packed to 2048 tokens, torch.compile), row")
TORCHAO = ("torchao low-bit optimizers README, https://github.com/pytorch/ao/tree/main/torchao/prototype/low_bit_optim"
           " (from https://github.com/pytorch/ao/pull/812), Llama2-7B table, row")
QLORA = ("QLoRA paper, Dettmers et al. 2023, https://arxiv.org/abs/2305.14314, abstract: \"finetune a 65B parameter"
         " model on a single 48GB GPU\"; setup from https://github.com/artidoro/qlora/blob/main/scripts/finetune_guanaco_65b.sh")

#: LitGPT's finetune/lora.py at 8641822: LoRA r=8, alpha 16, dropout 0.05 on query and value; AdamW
#: (weight decay 0.01; bitsandbytes' 32-bit PagedAdamW when quantized), bf16-true, no activation
#: checkpointing, micro-batch 1 of the longest Alpaca sample (1,304 Llama 2 tokens), the output
#: layer in chunks of 128 tokens, 128 samples per optimizer step.
_LITGPT_LORA = [
    "--trainer.precision=bf16-true", "--model.lora.r=8", "--model.lora.lora_alpha=16", "--model.lora.lora_dropout=0.05",
    "--model.lora.target_modules=[q_proj,v_proj]", "--model.logits_chunk_size=128",
    "--data.max_length=1304", "--data.max_tokens_per_batch=1304", "--trainer.accumulate_grad_batches=128",
]
_LITGPT_SFT = [*_LITGPT_LORA, "--model.dtype=bfloat16", "--trainer.callbacks=[]",
               "--model.optimizer=torch.optim.AdamW", "--model.optimizer.init_args.lr=0.0003",
               "--model.optimizer.init_args.weight_decay=0.01"]
_LITGPT_QLORA = [*_LITGPT_LORA, "--model.activation_checkpointing=false",
                 "--model.optimizer=bitsandbytes.optim.PagedAdamW", "--model.optimizer.init_args.lr=0.0003",
                 "--model.optimizer.init_args.weight_decay=0.01"]
_LITGPT_GAPS = ("LitGPT's own GPT module, not transformers' Llama; its output chunks stay alive together until"
                " the loss (1,304 x 32,000 bf16 = 0.08 GB) where ours are freed one by one; the peak is its"
                " run's maximum (validation and sample generation included)")
_LITGPT_NF4_GAPS = (_LITGPT_GAPS + "; Fabric's BitsandbytesPrecision quantizes every Linear, the output layer"
                    " included (ours keeps it in bf16: +0.19 GB at 7B, +0.24 GB at 13B)")

#: torchtune at 30b8519e8 (the README row's configs llama3_1/8B_*_single_device): bf16 everything,
#: activation checkpointing, batch 2 of 2,048 packed tokens, CEWithChunkedOutputLoss (8 chunks).
_TORCHTUNE = ["--trainer.precision=bf16-true", "--data.max_length=2048", "--data.max_tokens_per_batch=4096",
              "--model.logits_chunk_size=512", "--trainer.accumulate_grad_batches=1"]
_TORCHTUNE_GAPS = ("torch.compile (the README's numbers use it; the recipes do not compile); packed"
                   " sequences (same tokens as our two padded rows); torchtune's own Llama modules")

#: torchao's table ran torchtune 52d1b838 on Alpaca, full bf16; the README gives no other setting.
#: Assumed: that commit's llama2/7B_full_low_memory (batch 2, activation checkpointing) with the
#: optimizer swapped and its step after backward (the low-bit optimizers are not stepped in
#: backward), rows of Alpaca's longest sample (1,304 tokens). With the step in backward instead the
#: estimate is 12.5 GiB (all gradients) lower, 0.76 of the published figure.
_TORCHAO = ["--model.name_or_path=meta-llama/Llama-2-7b-hf", "--trainer.strategy=auto", "--trainer.precision=bf16-true",
            "--trainer.accumulate_grad_batches=1",
            '--trainer.callbacks=[{"class_path": "lightning_mem.callbacks.ActivationCheckpointing"}]',
            "--data.max_length=1304", "--data.max_tokens_per_batch=2608", "--model.logits_chunk_size=326"]
_TORCHAO_GAPS = ("settings assumed (the README names only model, data, full bf16, A100 and the torchtune commit):"
                 " 7B_full_low_memory's batch 2 and activation checkpointing, the step after backward, rows of"
                 " 1,304 tokens; its figures come from torchtune's logger, which divides by 2^30 (read as GiB)")


#: torchtune's single-device ladder (README on main, read 2026-11-26, "Optimization flags"): Llama 3.2 3B, batch 2,
#: max seq len 4,096, bf16, one A100, full_finetune_single_device, each lever added to the one before;
#: its figure is "Peak Memory Active" (the allocator's peak of active bytes). From "+ Packed Dataset" on
#: every row trains on 2 x 4,096 packed tokens; its unpacked baseline (25.5 GiB) pads Alpaca rows to the
#: longest in the batch, a length the README does not give, so it has no row here. Each rung is
#: configs/sft/llama-3.2-3b_1x80gb_ladder.yaml (the top rung) with the overrides in its header.
TORCHTUNE_LADDER = ("torchtune README, https://github.com/pytorch/torchtune/blob/main/README.md, table \"Optimization"
                    " flags\" (Llama 3.2 3B, batch 2 x 4,096 packed tokens, bf16, 1x A100, \"Peak Memory Active\"), row")
_LADDER_ADAMW = ["--model.optimizer=torch.optim.AdamW", "--model.optimizer.init_args.lr=2.0e-5"]
_LADDER_AC = '{"class_path": "lightning_mem.callbacks.ActivationCheckpointing"}'
_LADDER_OIB = '{"class_path": "lightning_mem.callbacks.OptimizerInBackward"}'
_LADDER_GAPS = "torchtune's own Llama modules; packed sequences (ours: two rows of 4,096 tokens, the same tokens)"
_LADDER_COMPILE = "; torch.compile from this rung on (60.0 GiB before it, 51.0 after): the recipes do not compile"
_LADDER = [
    ("packed", "+ Packed Dataset", "60.0 GiB", ["--model.logits_chunk_size=null", *_LADDER_ADAMW, "--trainer.callbacks=[]"], ""),
    ("chunked-ce", "+ Chunked Cross Entropy", "42.9 GiB", [*_LADDER_ADAMW, "--trainer.callbacks=[]"],
     f"{_LADDER_COMPILE}; the gap over 10 % is compile's: it took 15 % off the rung before, and 0.85 x this estimate"
     " is 0.96 of the figure"),
    ("activation-checkpointing", "+ Activation Checkpointing", "24.9 GiB",
     [*_LADDER_ADAMW, f"--trainer.callbacks=[{_LADDER_AC}]"], _LADDER_COMPILE),
    ("optimizer-in-backward", "+ Fuse optimizer step into backward", "23.1 GiB",
     [*_LADDER_ADAMW, f"--trainer.callbacks=[{_LADDER_AC}, {_LADDER_OIB}]"], _LADDER_COMPILE),
    ("activation-offload", "+ Activation Offloading", "21.8 GiB", _LADDER_ADAMW,
     f"{_LADDER_COMPILE}; measured on an H100 (2026-11-26, benchmarks/gpu/ladder.py): 20.19 GiB allocated, 0.99"
     " of that day's estimate (20.30 GiB)"),
    ("adamw8bit", "+ 8-bit AdamW", "17.6 GiB", [],
     f"{_LADDER_COMPILE}; the gap over 10 % is torchtune's rung, measured: on an H100 (2026-11-26,"
     " benchmarks/gpu/ladder.py) this config peaked at 14.29 GiB allocated (0.99 of that day's estimate, 14.41 GiB), and bf16 to"
     " 8-bit AdamW state took 5.90 GiB off the measured peak, what the state's bytes predict (5.98 GiB), where"
     " torchtune's figure drops 4.2 GiB; its README does not say which 8-bit AdamW it ran (ours: bitsandbytes'"
     " AdamW8bit, not paged)"),
]

@dataclass
class Setup:
    """One published figure and the config that expresses its run."""

    name: str
    source: str
    published: str  # as the source writes it
    published_bytes: int
    config: str
    overrides: list[str]
    unmatched: str
    bound: bool = False  # "fits on a <size> GPU": the figure is an upper bound, not a measurement
    #: bitsandbytes pages an optimizer's state tensors of 100,000 elements or more into CUDA managed
    #: memory, outside torch's allocator: ``max_memory_allocated`` (every published figure here)
    #: never counts them, and the driver may evict them to the host. True where that is all of the
    #: state that matters (full fine-tuning; LoRA with r x width >= 1e5).
    paged_state: bool = False


SETUPS = [
    Setup("litgpt-llama2-7b-lora", f"{LITGPT} \"7 B, Llama 2, None, 1\"", "21.30 GB", int(21.30 * GB),
          "configs/sft/llama-3.1-8b_lora_1x24gb.yaml", ["--model.name_or_path=meta-llama/Llama-2-7b-hf", *_LITGPT_SFT],
          _LITGPT_GAPS),
    Setup("litgpt-llama2-7b-qlora-nf4", f"{LITGPT} \"7 B, Llama 2, bnb.nf4, 1\"", "14.14 GB", int(14.14 * GB),
          "configs/qlora/llama-3.1-8b_1x24gb.yaml",
          ["--model.name_or_path=meta-llama/Llama-2-7b-hf", "--model.quantization.double_quant=false", *_LITGPT_QLORA],
          _LITGPT_NF4_GAPS),
    Setup("litgpt-llama2-7b-qlora-nf4-dq", f"{LITGPT} \"7 B, Llama 2, bnb.nf4-dq, 1\"", "13.84 GB", int(13.84 * GB),
          "configs/qlora/llama-3.1-8b_1x24gb.yaml",
          ["--model.name_or_path=meta-llama/Llama-2-7b-hf", "--model.quantization.double_quant=true", *_LITGPT_QLORA],
          _LITGPT_NF4_GAPS),
    Setup("litgpt-llama2-13b-lora", f"{LITGPT} \"13 B, Llama 2, None, 1\"", "38.12 GB", int(38.12 * GB),
          "configs/sft/llama-3.1-8b_lora_1x24gb.yaml", ["--model.name_or_path=meta-llama/Llama-2-13b-hf", *_LITGPT_SFT],
          _LITGPT_GAPS),
    Setup("litgpt-llama2-13b-qlora-nf4-dq", f"{LITGPT} \"13 B, Llama 2, bnb.nf4-dq, 1\"", "22.55 GB", int(22.55 * GB),
          "configs/qlora/llama-3.1-8b_1x24gb.yaml",
          ["--model.name_or_path=meta-llama/Llama-2-13b-hf", "--model.quantization.double_quant=true", *_LITGPT_QLORA],
          _LITGPT_NF4_GAPS),
    Setup("torchtune-llama3.1-8b-full", f"{TORCHTUNE} \"Llama 3.1 8B, Full finetune, 1x 4090\"", "18.9 GiB",
          int(18.9 * GiB), "configs/sft/llama-3.1-8b_1x24gb_optimizer_in_backward.yaml", [],
          f"{_TORCHTUNE_GAPS}; config llama3_1/8B_full_single_device (paged 8-bit AdamW stepped in backward, as the"
          " shipped config here: `OptimizerInBackward`, one gradient alive at a time)", paged_state=True),
    Setup("torchtune-llama3.1-8b-lora", f"{TORCHTUNE} \"Llama 3.1 8B, LoRA, 1x 4090\"", "16.2 GiB", int(16.2 * GiB),
          "configs/sft/llama-3.1-8b_lora_1x24gb.yaml",
          [*_TORCHTUNE, "--model.lora.r=8", "--model.lora.lora_alpha=16", "--model.lora.lora_dropout=0.0",
           "--model.lora.target_modules=[q_proj,v_proj]", "--model.optimizer=torch.optim.AdamW"],
          f"{_TORCHTUNE_GAPS}; config llama3_1/8B_lora_single_device (LoRA r=8 on q and v, fused AdamW: ours"
          " is the default foreach AdamW)"),
    Setup("torchtune-llama3.1-8b-qlora", f"{TORCHTUNE} \"Llama 3.1 8B, QLoRA, 1x 4090\"", "7.4 GiB", int(7.4 * GiB),
          "configs/qlora/llama-3.1-8b_1x24gb.yaml",
          [*_TORCHTUNE, "--model.lora.r=8", "--model.lora.lora_alpha=16", "--model.lora.lora_dropout=0.0",
           "--model.lora.target_modules=all-linear", "--model.quantization.double_quant=true",
           "--model.activation_checkpointing=true", "--model.optimizer=torch.optim.AdamW"],
          f"{_TORCHTUNE_GAPS}; config llama3_1/8B_qlora_single_device (LoRA r=8 on q, k, v, o and the MLP);"
          " torchao's NF4 tensors (block 64, scales quantized in blocks of 256) where ours are bitsandbytes'"),
    *(Setup(f"torchtune-llama3.2-3b-ladder-{rung}", f"{TORCHTUNE_LADDER} \"{row}\"", published, int(float(published.split()[0]) * GiB),
            "configs/sft/llama-3.2-3b_1x80gb_ladder.yaml", overrides, f"{_LADDER_GAPS}{extra}")
      for rung, row, published, overrides, extra in _LADDER),
    Setup("torchao-llama2-7b-adamw", f"{TORCHAO} \"PyTorch (fused)\"", "51.6 GiB (written \"GB\")", int(51.6 * GiB),
          "configs/sft/llama-3.1-8b_1x24gb.yaml", [*_TORCHAO, "--model.optimizer=torch.optim.AdamW"],
          f"{_TORCHAO_GAPS}; fused AdamW (ours: foreach)"),
    Setup("torchao-llama2-7b-bnb-adamw8bit", f"{TORCHAO} \"bnb 8-bit\"", "39.3 GiB (written \"GB\")", int(39.3 * GiB),
          "configs/sft/llama-3.1-8b_1x24gb.yaml", [*_TORCHAO, "--model.optimizer=bitsandbytes.optim.AdamW8bit"],
          _TORCHAO_GAPS),
    Setup("qlora-paper-llama-65b", QLORA, "< 48 GiB (fits one 48 GB GPU)", 48 * GiB,
          "configs/qlora/llama-3.1-70b_1x80gb.yaml",
          ["--model.name_or_path=huggyllama/llama-65b", "--trainer.precision=bf16-true", "--model.lora.r=64",
           "--model.lora.lora_alpha=16", "--model.lora.lora_dropout=0.05", "--model.lora.target_modules=all-linear",
           "--model.quantization.double_quant=true", "--model.activation_checkpointing=true",
           "--model.optimizer=bitsandbytes.optim.PagedAdamW", "--model.optimizer.init_args.lr=0.0001",
           "--data.max_length=528", "--data.max_tokens_per_batch=2112", "--trainer.accumulate_grad_batches=4"],
          "a bound, not a measurement (the script's batch: 4 rows of 16 + 512 tokens; the paper's figure 6 gives"
          " its breakdown at 512 tokens, batch 1); qlora.py keeps norms in fp32 and embeddings, output layer and"
          " LoRA in bf16 (ours: all bf16)", bound=True, paged_state=True),
]


def run(setup: Setup) -> dict:
    """Estimate ``setup`` (one rank) and set it beside the published figure."""
    from lightning_mem.estimate import estimate, usable_bytes

    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = estimate(ROOT / setup.config, setup.overrides, world_size=1)
    peak = result.device_peak_bytes
    row = {"name": setup.name, "published": setup.published, "published_bytes": setup.published_bytes,
           "estimated_bytes": peak, "ratio": peak / setup.published_bytes, "bound": setup.bound,
           "phases": {p.phase: p.device_breakdown_bytes for p in result.phases},
           "seconds": time.perf_counter() - start}
    if setup.paged_state:
        # The estimate counts paged state in managed memory, off the device but for one parameter's
        # pages; the other way round, all of it on the device (a platform that cannot page).
        row["paged_bytes"] = result.paged_state_bytes
        row["on_device_bytes"] = peak + row["paged_bytes"]
        row["on_device_ratio"] = row["on_device_bytes"] / setup.published_bytes
    if setup.bound:
        row["fits_bound"] = peak <= usable_bytes(setup.published_bytes)
    return row


def _figure(value_bytes: int, published: str) -> str:
    # In the unit the source uses, so the two numbers read side by side.
    return f"{value_bytes / GiB:.2f} GiB" if "GiB" in published else f"{value_bytes / GB:.2f} GB"


def markdown(rows: list[dict], setups: dict[str, Setup], *, date: str, versions: str) -> str:
    lines = [
        f"Estimated {date} on CPU ({versions}) by `python benchmarks/published_figures.py`: tracked tensor bytes of",
        "the largest phase, one GPU, against each source's `torch.cuda.max_memory_allocated` peak. A ratio above 1",
        "means the estimate is higher than the published figure. Not a GPU measurement. bitsandbytes' paged",
        "optimizers keep their large state tensors in CUDA managed memory, which `max_memory_allocated` does not",
        "count (and the driver may move to the host): the estimate counts that state on the host but for the",
        "pages of the parameter being updated, the figure comparable to the published one; the column beside it",
        "gives the estimate with all of it on the device (a platform that cannot page).",
        "",
        "| setup | published | estimated | estimated / published | with the paged optimizer state on the device | source |"
        " what the config could not match |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [_row_line(row, setups[row["name"]]) for row in rows]
    lines += ["", "Each setup, as `python -m lightning_mem.estimate --config <config> <overrides>` runs it:", ""]
    lines += [_bullet(setups[row["name"]]) for row in rows]
    return "\n".join(lines) + "\n"


def _row_line(row: dict, setup: Setup, date: str = "") -> str:
    # ``date``: set where the row was estimated on another day than the rest of the table.
    when = f" ({date})" if date else ""
    if "error" in row:
        return (f"| `{row['name']}` | {setup.published} | error{when}: {row['error']} | n/a | n/a | {setup.source} |"
                f" {setup.unmatched} |")
    ratio = f"{row['ratio']:.2f}"
    if row["bound"]:
        ratio += " (fits with the estimator's margin)" if row["fits_bound"] else " (does not fit with the margin)"
    paged = "not paged"
    if "paged_bytes" in row:
        paged = (f"{_figure(row['on_device_bytes'], setup.published)} ({row['on_device_ratio']:.2f}) with"
                 f" {_figure(row['paged_bytes'], setup.published)} of paged state")
    return (f"| `{row['name']}` | {setup.published} | {_figure(row['estimated_bytes'], setup.published)}{when} |"
            f" {ratio} | {paged} | {setup.source} | {setup.unmatched} |")


def _bullet(setup: Setup) -> str:
    overrides = f"`{' '.join(setup.overrides)}`" if setup.overrides else "(as shipped)"
    return f"- `{setup.name}`: `{setup.config}` {overrides}"


def merge_into(doc: Path, rows: list[dict], *, date: str) -> None:
    """Replace (or add, in the order of ``SETUPS``) the lines of ``rows`` in the table of ``doc``.

    For re-estimating a few setups without the hours the whole table takes: a row estimated on
    another day than the table's header says carries its date beside its estimate.
    """
    text = doc.read_text()
    head, rest = text.split(BEGIN, 1)
    body, tail = rest.split(END, 1)
    lines = body.split("\n")
    header_date = next((ln.split()[1] for ln in lines if ln.startswith("Estimated ")), "")
    order = [s.name for s in SETUPS]
    setups = {s.name: s for s in SETUPS}

    def place(prefix: str, name: str, new: str) -> None:
        at = next((i for i, ln in enumerate(lines) if ln.startswith(prefix.format(name))), None)
        if at is not None:
            lines[at] = new
            return
        before = [n for n in order[: order.index(name)]]
        spots = [i for i, ln in enumerate(lines) for n in before if ln.startswith(prefix.format(n))]
        lines.insert(max(spots) + 1, new)

    # The prose and the column names above the rows follow this script (its first line, which names
    # the day and versions of the whole table, stays).
    first = next((i for i, ln in enumerate(lines) if ln.startswith("Estimated ")), None)
    rule = next((i for i, ln in enumerate(lines) if ln.startswith("|---")), None)
    if first is not None and rule is not None:
        fresh = markdown([], setups, date=header_date, versions="").split("\n")
        lines[first + 1 : rule + 1] = fresh[1 : fresh.index(next(ln for ln in fresh if ln.startswith("|---"))) + 1]
    for row in rows:
        name = row["name"]
        place("| `{}` |", name, _row_line(row, setups[name], "" if date == header_date else date))
        place("- `{}`:", name, _bullet(setups[name]))
    doc.write_text(f"{head}{BEGIN}{chr(10).join(lines)}{END}{tail}")


def write_into(doc: Path, table: str) -> None:
    """Replace what is between the markers in ``doc`` (which must hold both) with ``table``."""
    text = doc.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{doc}: the markers {BEGIN!r} and {END!r} are missing")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(f"{head}{BEGIN}\n{table}{END}{tail}")


def _versions() -> str:
    import torch

    import lightning_mem

    return f"torch {torch.__version__}, lightning-mem {lightning_mem.__version__}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/published_figures.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", default=[], help="setups whose name contains this (repeatable)")
    parser.add_argument("--write", action="store_true", help=f"write the table into {DOC.relative_to(ROOT)}")
    parser.add_argument("--merge", action="store_true",
                        help=f"replace (or add) only the chosen setups' rows in {DOC.relative_to(ROOT)}, dated where the day differs")
    parser.add_argument("--json", type=Path, help="also write the rows (with per-phase breakdowns) to this file")
    parser.add_argument("--rows", type=Path, help="render rows saved by --json (same date and versions) instead of estimating")
    args = parser.parse_args(argv)
    chosen = [s for s in SETUPS if not args.only or any(o in s.name for o in args.only)]
    if not chosen:
        parser.error(f"no setup matches {args.only}; setups: {[s.name for s in SETUPS]}")
    if args.write and len(chosen) != len(SETUPS) and args.rows is None:
        parser.error("--write rewrites the whole table: run it without --only")
    rows = []
    if args.rows is not None:
        saved = json.loads(args.rows.read_text())
        rows, chosen = saved["rows"], []
        date, versions = saved["date"], saved["versions"]
    else:
        date, versions = datetime.date.today().isoformat(), _versions()
    for index, setup in enumerate(chosen, 1):
        print(f"[{index}/{len(chosen)}] {setup.name} ...", file=sys.stderr, flush=True)
        try:
            row = run(setup)
        except Exception as err:  # noqa: BLE001 - a setup the recipes cannot run is a row that says so
            row = {"name": setup.name, "published": setup.published, "error": f"{type(err).__name__}: {str(err).splitlines()[0]}"}
        rows.append(row)
        took = f" in {row['seconds']:.0f} s" if "seconds" in row else ""
        print(f"[{index}/{len(chosen)}] {setup.name}: {row.get('ratio', row.get('error'))}{took}", file=sys.stderr, flush=True)
    table = markdown(rows, {s.name: s for s in SETUPS}, date=date, versions=versions)
    print(table)
    if args.json:
        args.json.write_text(json.dumps({"date": date, "versions": versions, "rows": rows}, indent=1))
    if args.write:
        write_into(DOC, table)
    if args.merge:
        merge_into(DOC, rows, date=date)
    return 0


if __name__ == "__main__":
    sys.exit(main())
