"""Logit distillation: the loss's bytes at a real vocabulary (exact, fake tensors) and its step time.

    python benchmarks/distillation.py --skip-speed          # bytes only (about a minute)
    python benchmarks/distillation.py --rounds 20           # and the CPU step time, interleaved

Bytes: the divergence of a student from a teacher at Qwen2.5's vocabulary (151,936), the student
with Qwen2.5-0.5B's width (896) and fp32 parameters under bf16 autocast, the teacher with
Qwen2.5-7B's (3,584) in bf16, 8,192 scored tokens, on fake tensors (no memory, no arithmetic):
each storage the loss allocates is counted from its creation to its release, exactly. The forward's
figure is its peak; the backward's is its peak less the gradients it returns (the student's hidden
rows and output weight, fp32). Each is divided by one chunk of ``[chunk, vocab]`` fp32 logits: the
loss is built to stay within 1.5 of them beside its inputs (lightning_mem.distillation.divergences).
For scale, the last rows measure the usual way: both output layers on all rows and the divergence
on the whole logits (``reference_rows``, TRL's formulation), in chunks of 512 rows.

Step time: one SFT step (forward, backward, AdamW) of the tiny student (assets/tiny-llama-student)
on a 1,024-token micro-batch of the shipped arithmetic data, without and with logit distillation
from the 4-block tiny model (forward KL, the teacher resident), and with the teacher's forward
alone (its hidden states dropped: the rest is the divergence's own cost), in alternating rounds so
that load from other jobs falls on all alike; the median per variant.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import weakref
from pathlib import Path

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lightning_mem.distillation import Divergence, distillation_divergence, reference_rows  # noqa: E402

VOCAB, STUDENT_HIDDEN, TEACHER_HIDDEN = 151_936, 896, 3584


class NewBytes(TorchDispatchMode):
    """Bytes of the storages made inside the mode and still alive, and their peak (exact, also on
    fake tensors): a storage first seen as an op's output is new until it is freed."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.now = self.peak = 0

    def _freed(self, nbytes: int) -> None:
        self.now -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor):
                self.seen.setdefault(t.untyped_storage(), False)
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            storage = t.untyped_storage() if isinstance(t, torch.Tensor) else None
            if storage is not None and storage not in self.seen:
                self.seen[storage] = True
                self.now += storage.nbytes()
                self.peak = max(self.peak, self.now)
                weakref.finalize(storage, self._freed, storage.nbytes())
        return out


def loss_transients(kind: str, top_k: int | None, *, tokens: int = 8192, chunk: int | None = 512,
                    vocab: int = VOCAB, autocast: bool = True, whole: bool = False) -> tuple[int, int]:
    """``(forward peak, backward peak less its returned gradients)`` in bytes (module docstring).
    ``whole``: the usual way instead, both output layers on all rows and
    :func:`~lightning_mem.distillation.divergences.reference_rows` on the whole logits."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        student = nn.Linear(STUDENT_HIDDEN, vocab, bias=False, device="meta")
        student.weight = nn.Parameter(torch.empty(vocab, STUDENT_HIDDEN))
        teacher = nn.Linear(TEACHER_HIDDEN, vocab, bias=False, device="meta")
        teacher.weight = nn.Parameter(torch.empty(vocab, TEACHER_HIDDEN, dtype=torch.bfloat16), requires_grad=False)
        hidden = torch.empty(tokens, STUDENT_HIDDEN, requires_grad=True)
        teacher_hidden = torch.empty(tokens, TEACHER_HIDDEN, dtype=torch.bfloat16)
        forward = NewBytes()
        with forward, torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False, enabled=autocast):
            if whole:
                with torch.no_grad():
                    teacher_logits = teacher(teacher_hidden)
                loss = reference_rows(student(hidden), teacher_logits, Divergence(kind, 0.5), top_k=top_k).sum()
                del teacher_logits
            else:
                loss = distillation_divergence(hidden, student, teacher_hidden, teacher,
                                               divergence=Divergence(kind, 0.5), top_k=top_k, chunk_size=chunk).sum()
        backward = NewBytes()
        with backward:
            loss.backward()
        returned = vocab * STUDENT_HIDDEN * 4 + tokens * STUDENT_HIDDEN * 4
        assert backward.now == returned, (backward.now, returned)  # nothing else outlives the backward
    return forward.peak, backward.peak - returned


def bytes_table(tokens: int, chunks: list[int]) -> list[str]:
    rows = ["| divergence | top-k | chunk | forward | backward | (x one [chunk, vocab] fp32) |", "|---|---|---|---|---|---|"]
    for kind, top_k in (("forward_kl", None), ("reverse_kl", None), ("jsd", None), ("forward_kl", 64), ("jsd", 64)):
        for chunk in chunks:
            forward, backward = loss_transients(kind, top_k, tokens=tokens, chunk=chunk)
            unit = chunk * VOCAB * 4
            rows.append(f"| {kind} | {top_k or '-'} | {chunk} | {forward / 2**20:,.0f} MiB | {backward / 2**20:,.0f} MiB"
                        f" | {forward / unit:.2f} / {backward / unit:.2f} |")
    for kind in ("forward_kl", "jsd"):
        forward, backward = loss_transients(kind, None, tokens=tokens, whole=True)
        unit = 512 * VOCAB * 4
        rows.append(f"| {kind}, whole logits | - | all | {forward / 2**20:,.0f} MiB | {backward / 2**20:,.0f} MiB"
                    f" | {forward / unit:.2f} / {backward / unit:.2f} (of 512 rows) |")
    return rows


def _step_runner(distill: bool, *, loss: bool = True):
    """One SFT step of the tiny student, with or without the tiny teacher's forward KL (``loss=False``:
    the teacher's forward runs, its hidden states are dropped: what the divergence itself costs)."""
    from lightning_mem.data import SFTDataModule
    from lightning_mem.distillation import DistillationSettings, LogitDistillation, TeacherSettings
    from lightning_mem.logits import score_tokens
    from lightning_mem.models import load_causal_lm

    torch.manual_seed(0)
    student = load_causal_lm(str(ROOT / "assets/tiny-llama-student"), dtype="float32").train()
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-3)
    kd = None
    if distill:
        kd = LogitDistillation(DistillationSettings(TeacherSettings(str(ROOT / "assets/tiny-llama"))))
        kd.check(str(ROOT / "assets/tiny-llama-student"))
        kd.teacher.load(student_device=torch.device("cpu"), compute_dtype=torch.float32, width=kd.vocabulary.width)
    data = SFTDataModule(str(ROOT / "data/arithmetic/train.jsonl"), tokenizer=str(ROOT / "assets/tiny-llama"),
                         max_length=64, max_tokens_per_batch=1024)
    data.setup()
    batch = next(iter(data.train_dataloader()))

    def step() -> None:
        positions, targets = batch["target_positions"], batch["target_ids"]
        hidden = kd.teacher_hidden(batch["input_ids"], batch["attention_mask"], positions) if kd else None
        distilled = kd is not None and loss
        out = score_tokens(student, batch["input_ids"], batch["attention_mask"], positions, targets, chunk_size=512,
                           extra=kd.in_forward(hidden, chunk_size=512) if distilled else None)
        total = -out.logprobs.sum()
        if distilled:
            total = kd.mix(total, out.extra.sum())
        (total / targets.numel()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def step_times(rounds: int, steps: int) -> dict[str, float]:
    runners = {"sft": _step_runner(False), "sft + the teacher's forward": _step_runner(True, loss=False),
               "sft + distillation": _step_runner(True)}
    for run in runners.values():  # warm-up
        run()
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(rounds):
        for name, run in runners.items():
            start = time.perf_counter()
            for _ in range(steps):
                run()
            times[name].append((time.perf_counter() - start) / steps)
    return {name: statistics.median(values) for name, values in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--chunks", default="512,128")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=5, help="steps per round and variant")
    parser.add_argument("--skip-speed", action="store_true")
    args = parser.parse_args(argv)
    print(f"bytes at vocabulary {VOCAB:,}, {args.tokens:,} scored tokens, student {STUDENT_HIDDEN} / teacher {TEACHER_HIDDEN}:")
    print("\n".join(bytes_table(args.tokens, [int(c) for c in args.chunks.split(",")])))
    if not args.skip_speed:
        for name, seconds in step_times(args.rounds, args.steps).items():
            print(f"{name}: {seconds * 1000:.1f} ms per step (median of {args.rounds} rounds x {args.steps} steps)")


if __name__ == "__main__":
    main()
