"""The fused output layer of this tree against the same at a git revision: bytes and time, interleaved.

    python benchmarks/logits_head.py --rev 072f000                          # bytes at 4,096 rows, chunks of 512
    python benchmarks/logits_head.py --rev 072f000 --time --rows 128 --chunk-size 8 --rounds 6

The head is Qwen2.5-0.5B's (vocabulary 151,936 x hidden 896, fp32 weight) under Lightning's
bf16-mixed autocast (cache off), scoring ``--rows`` hidden rows with an SFT loss (``-sum(logprobs)``):
``lightning_mem.logits.fused_logprobs``, forward and backward, nothing else. The revision's
``lightning_mem/logits.py`` is read with ``git show`` and imported beside this tree's.

Bytes (fake tensors under torch's MemTracker: exact, no real memory, any machine): above the
inputs, what the forward leaves alive for the backward, the forward's peak and the backward's.
In a training step the head's backward runs beside every saved activation, so its peak adds to
the step's.

Time (``--time``, real tensors on the CPU): the median of ``--rounds`` forward + backward passes
of each version, the two alternating each round so that load from other jobs falls on both alike;
also the largest difference of their log-probs and gradients.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

VOCAB, HIDDEN = 151_936, 896


def module_at(rev: str | None) -> ModuleType:
    """``lightning_mem.logits`` of this tree (``rev`` None) or as committed at ``rev``."""
    if rev is None:
        import lightning_mem.logits as here

        return here
    source = subprocess.run(["git", "show", f"{rev}:lightning_mem/logits.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / f"logits_{rev}.py"
    path.write_text(source)
    name = f"logits_at_{rev}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def _autocast() -> torch.autocast:
    return torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False)


def head_bytes(logits: ModuleType, rows: int, chunk_size: int | None, vocab: int = VOCAB,
               hidden: int = HIDDEN) -> tuple[int, int, int]:
    """``(bytes kept by the forward, forward peak, backward peak)`` above the inputs, on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    def total(tracker: MemTracker, kind: str = "current") -> int:
        return next(iter(tracker.get_tracker_snapshot(kind).values()))["Total"]

    with FakeTensorMode():
        weight = torch.nn.Parameter(torch.empty(vocab, hidden))
        states = torch.empty(rows, hidden, requires_grad=True)
        targets = torch.zeros(rows, dtype=torch.long)
        tracker = MemTracker()
        tracker.track_external(weight, states, targets)
        with tracker:
            inputs = total(tracker)
            with _autocast():
                logprobs, _ = logits.fused_logprobs(states, targets, weight, chunk_size=chunk_size)
            kept, forward_peak = total(tracker), total(tracker, "peak")
            tracker.reset_mod_stats()
            (-logprobs.sum()).backward()
            backward_peak = total(tracker, "peak")
    return kept - inputs, forward_peak - inputs, backward_peak - inputs


def _pass(logits: ModuleType, weight: torch.Tensor, states: torch.Tensor, targets: torch.Tensor,
          chunk_size: int | None) -> tuple[torch.Tensor, ...]:
    weight.grad = states.grad = None
    with _autocast():
        logprobs, _ = logits.fused_logprobs(states, targets, weight, chunk_size=chunk_size)
    (-logprobs.sum() / states.shape[0]).backward()
    return logprobs.detach(), weight.grad, states.grad


def head_time(versions: dict[str, ModuleType], rows: int, chunk_size: int | None, rounds: int) -> dict[str, float]:
    """Median seconds of one forward + backward per version (alternating), and the largest differences."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN) * 0.02)
    states = torch.randn(rows, HIDDEN, requires_grad=True)
    targets = torch.randint(0, VOCAB, (rows,))
    first = [_pass(m, weight, states, targets, chunk_size) for m in versions.values()]  # also the warm-up
    out: dict[str, float] = {}
    for name, a, b in zip(("logprobs", "weight grad", "hidden grad"), *first):
        out[f"max |diff| {name}"] = (a - b).abs().max().item()
    times: dict[str, list[float]] = {name: [] for name in versions}
    for _ in range(rounds):
        for name, module in versions.items():
            start = time.perf_counter()
            _pass(module, weight, states, targets, chunk_size)
            times[name].append(time.perf_counter() - start)
    for name, values in times.items():
        out[f"{name} s"] = statistics.median(values)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rev", required=True, help="the git revision to compare with (e.g. 072f000)")
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--chunk-size", type=int, default=512, help="rows per chunk; 0: one chunk")
    parser.add_argument("--time", action="store_true", help="also time both on this CPU (real tensors)")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args(argv)
    chunk = args.chunk_size or None
    versions = {args.rev: module_at(args.rev), "this tree": module_at(None)}
    print(f"fused head {VOCAB} x {HIDDEN}, {args.rows} rows, chunk size {chunk}, bf16 autocast; GiB above the inputs")
    print("| version | kept for backward | forward peak | backward peak |")
    print("|---|---|---|---|")
    for name, module in versions.items():
        kept, forward, backward = head_bytes(module, args.rows, chunk)
        print(f"| {name} | {kept / 2**30:.3f} | {forward / 2**30:.3f} | {backward / 2**30:.3f} |")
    if args.time:
        result = head_time(versions, args.rows, chunk, args.rounds)
        for key, value in result.items():
            print(f"{key}: {value:.4g}")
        print(f"this tree / {args.rev}: {result['this tree s'] / result[f'{args.rev} s']:.3f}")


if __name__ == "__main__":
    main()
