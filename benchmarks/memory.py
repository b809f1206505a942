"""Measure what each memory technique saves, on any device, and print a Markdown table.

    python benchmarks/memory.py                                   # tiny model, CPU or GPU
    python benchmarks/memory.py --model Qwen/Qwen2.5-0.5B --dtype bfloat16 --tokens 8192   # on a GPU

Exact bytes (any device): parameter, gradient and optimizer-state bytes, and the unique bytes saved
for backward. On CUDA also the peak allocated memory of one training step and its time. Each row
is one technique on top of the baseline; copy the table into docs/benchmarks.md with the date,
the device and this command.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lightning_mem.activation_offload import ActivationOffloader  # noqa: E402
from lightning_mem.models import load_causal_lm, resolve_dtype  # noqa: E402
from lightning_mem.offload import optimizer_state_to_device, optimizer_state_to_host  # noqa: E402
from lightning_mem.optim import optimizer_state_bytes, param_groups  # noqa: E402


def _checkpoint_blocks(model: torch.nn.Module) -> None:
    # The same composable, non-reentrant checkpoint FSDP2Strategy applies per block.
    from torch.distributed._composable import checkpoint

    for name in model._no_split_modules:
        for module in model.modules():
            if type(module).__name__ == name:
                checkpoint(module)


def _make_optimizer(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    groups = param_groups(model, weight_decay=0.0)
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=1e-5)
    import bitsandbytes as bnb

    return {"adamw8bit": bnb.optim.AdamW8bit, "paged_adamw8bit": bnb.optim.PagedAdamW8bit}[kind](groups, lr=1e-5)


@contextlib.contextmanager
def _counting_saved_bytes(stats: dict, param_storages: set[int]) -> Iterator[None]:
    """Unique bytes autograd saves for backward (each storage once, parameters excluded)."""
    seen: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if key not in param_storages and key not in seen:
            seen.add(key)
            stats["saved_bytes"] = stats.get("saved_bytes", 0) + t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


def measure(args: argparse.Namespace, name: str, *, checkpointing=False, act_offload=False,
            optimizer="adamw", state_offload=False) -> dict:
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = load_causal_lm(args.model, dtype=args.dtype).to(device)
    model.config.use_cache = False
    if checkpointing:
        _checkpoint_blocks(model)
    opt = _make_optimizer(optimizer, model)
    vocab = model.config.vocab_size
    batch = torch.randint(0, vocab, (args.batch, args.tokens // args.batch), device=device)

    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def step(stats: dict | None) -> None:
        offloader = ActivationOffloader(model, device=device, min_bytes=args.min_bytes) if act_offload else None
        if offloader is not None:
            with offloader:
                loss = model(input_ids=batch, labels=batch).loss
        else:
            with _counting_saved_bytes(stats if stats is not None else {}, param_storages):
                loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        if stats is not None and offloader is not None:
            stats["saved_bytes"] = offloader.stats.stashed_bytes
        if state_offload:
            optimizer_state_to_device(opt)  # back for the step only
        opt.step()
        opt.zero_grad(set_to_none=True)
        if state_offload:
            optimizer_state_to_host(opt)

    step(None)  # warm-up: optimizer state exists from here on
    stats: dict = {}
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    step(stats)
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    row = {
        "technique": name,
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        # With state offload the state is on the host between steps: none of it stays on the device.
        "optimizer_state_bytes": optimizer_state_bytes(opt),
        "saved_activation_bytes": stats.get("saved_bytes", 0),
        "step_s": elapsed,
    }
    if device.type == "cuda":
        row["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
    return row


TECHNIQUES: list[tuple[str, dict]] = [
    ("baseline (AdamW)", {}),
    ("activation checkpointing", {"checkpointing": True}),
    ("activation offload", {"act_offload": True}),
    ("checkpointing + activation offload", {"checkpointing": True, "act_offload": True}),
    ("8-bit AdamW", {"optimizer": "adamw8bit"}),
    ("optimizer-state offload between steps", {"state_offload": True}),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="assets/tiny-llama")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per step (batch x sequence)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--min-bytes", type=int, default=1024)
    args = parser.parse_args()
    resolve_dtype(args.dtype, key="--dtype")
    rows = [measure(args, name, **kwargs) for name, kwargs in TECHNIQUES]
    base = rows[0]
    cuda = "peak_allocated_bytes" in base
    header = "| technique | optimizer state MB | saved for backward MB | step s |" + (" peak allocated MB | vs baseline |" if cuda else "")
    print(f"model {args.model}, {args.tokens} tokens/step, device {args.device}"
          f" ({torch.cuda.get_device_name() if cuda else 'CPU'}), torch {torch.__version__}\n")
    print(header)
    print("|---|---|---|---|" + ("---|---|" if cuda else ""))
    for r in rows:
        line = (f"| {r['technique']} | {r['optimizer_state_bytes'] / 1e6:.2f} | {r['saved_activation_bytes'] / 1e6:.2f}"
                f" | {r['step_s']:.3f} |")
        if cuda:
            line += f" {r['peak_allocated_bytes'] / 1e6:.0f} | {r['peak_allocated_bytes'] / base['peak_allocated_bytes']:.2f}× |"
        print(line)


if __name__ == "__main__":
    main()
