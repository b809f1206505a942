"""A teacher's top-k distribution, stored, as the signal at every position: on-policy distillation's dense signal.

The one-sample on-policy signal (:mod:`lightning_mem.rl.distillation`) tells the student, at each
position, the teacher's log-prob of the one token it sampled. Here the teacher's phase keeps, at
every sampled position, its ``k`` most likely next tokens and their log-probs (``[N, R, k]``,
:func:`teacher_top_k`), and the student's update compares its own distribution with them there
(:func:`top_k_divergence` of :func:`student_logprobs_at`), as NeMo RL's on-policy distillation
and TRL's GKD (with its ``lmbda`` at 1: the student's samples only) do.

Conventions (each peer's, and the choice here):

- NeMo RL (``DistillationLossFn``, ``topk_logits_k``) stores the teacher's top-k logits and, by
  default, renormalises **both** models' log-probs over those ``k`` tokens (a log-softmax of the
  gathered logits), dropping the tail; with ``zero_outside_topk`` it keeps the student's full
  normaliser and adds, for the reverse KL, the student's mass and entropy outside the top-k
  against a near-zero teacher. TRL's GKD compares the whole vocabulary (no top-k).
- Here both log-probs keep their **full-vocabulary normaliser** (the teacher's from its whole
  log-softmax in its phase, the student's from its whole output layer in the update), and the rest
  of the vocabulary is **one more outcome, the tail**: each position compares two distributions
  over ``k + 1`` outcomes, the ``k`` tokens and "any other token" with mass ``1 - sum``. This is a
  true divergence for each of forward KL, reverse KL and TRL's generalized JSD (at least 0, 0 only
  where the student matches the teacher on the top-k and so on the tail), it cannot be lowered by
  moving the student's mass off the top-k (a renormalised or tail-less reverse KL can), and at
  ``k`` = the vocabulary it is the full divergence exactly (no tail is then added).

Memory: the teacher's phase holds one chunk of ``[rows, vocab]`` fp32 logits at a time (reduced
in place to log-probs, then to their top-k); what is kept is ``k`` fp32 log-probs and ``k`` int32
ids per response token, ``8 k`` bytes. The update reads the student's output layer a vocabulary
slice at a time (:func:`student_logprobs_at`: the running log-sum-exp and the ``[n, k]`` logits
at the stored ids, then a backward that recomputes each slice), within one and a half chunks of
``[chunk, vocab]`` fp32, as :mod:`.divergences` does.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lightning_mem.distillation.divergences import (
    Divergence,
    RunningLogSumExp,
    SliceSpec,
    compute_dtype,
    extra_bytes,
    logprob_divergence,
    slice_logits,
    slice_width,
    student_grads,
    top_k_slice_grad,
)
from lightning_mem.logits import fusable, rows_per_chunk


@torch.no_grad()
def teacher_top_k(hidden: Tensor, output_layer: nn.Module, targets: Tensor, *, k: int, width: int,
                  temperature: float = 1.0, chunk_size: int | str | None = "auto") -> tuple[Tensor, Tensor, Tensor]:
    """``(target [n], top [n, k], ids [n, k])``: the log-prob of each ``targets`` token and the ``k``
    largest log-probs with their token ids (int32), of ``output_layer`` applied to ``hidden``
    (``[n, H]``), over its first ``width`` columns, divided by ``temperature``; fp32. One chunk of
    rows at a time: a chunk's ``[rows, width]`` fp32 logits are the only vocabulary-wide tensor."""
    n = hidden.shape[0]
    rows = rows_per_chunk(chunk_size, n, width)
    target, top, ids = [], [], []
    for start in range(0, n, rows):
        z = output_layer(hidden[start : start + rows])[:, :width].float()
        if temperature != 1.0:
            z.div_(temperature)
        z.sub_(torch.logsumexp(z, dim=-1, keepdim=True))
        target.append(z.gather(-1, targets[start : start + rows].long().unsqueeze(-1)).squeeze(-1))
        values, index = z.topk(k, dim=-1)
        top.append(values)
        ids.append(index.to(torch.int32))
        del z
    if not top:
        empty = hidden.new_zeros((0, k), dtype=torch.float32)
        return empty[:, 0], empty, empty.to(torch.int32)
    return torch.cat(target), torch.cat(top), torch.cat(ids)


class _LogprobsAt(torch.autograd.Function):
    """``[n, k]`` log-probs of the student at ``index`` (fp32, full normaliser over ``spec.width``
    columns), from its hidden rows and output weight a vocabulary slice at a time."""

    @staticmethod
    def forward(ctx, hs, ws, bs, index, spec: SliceSpec):
        ds = compute_dtype(ws)
        with torch.autocast(ws.device.type, enabled=False):
            hsc = hs.to(ds)
            width = slice_width(hs.shape[0], spec, hs.shape[1], 0, student_bytes=extra_bytes(ds), teacher_bytes=0)
            lse = RunningLogSumExp(hs.shape[0], hs.device)
            picked = torch.zeros(index.shape, dtype=torch.float32, device=hs.device)
            for start in range(0, spec.width, width):
                stop = min(start + width, spec.width)
                z = slice_logits(hsc, ws, bs, start, stop, ds, spec.temperature)
                inside = (index >= start) & (index < stop)
                picked = torch.where(inside, z.gather(-1, (index - start).clamp(0, stop - start - 1)), picked)
                lse.add(z)  # consumes z
                del z
            lse = lse.value()
        ctx.spec, ctx.width, ctx.dtype = spec, width, ds
        ctx.save_for_backward(hs, ws, bs, index, lse)
        return picked - lse.unsqueeze(-1)

    @staticmethod
    def backward(ctx, upstream):
        hs, ws, bs, index, lse = ctx.saved_tensors
        spec = ctx.spec
        g_top = upstream.float() / spec.temperature
        g_sum = g_top.sum(-1)
        with torch.autocast(ws.device.type, enabled=False):
            gh, gw, gb = student_grads(
                hs, ws, bs, lse, ctx.needs_input_grad[:3], spec.width, ctx.width, ctx.dtype, spec.temperature,
                lambda ls, start, stop: top_k_slice_grad(ls, index, g_top, g_sum, start, stop))
        return gh, gw, gb, None, None


def _module_rows(hidden: Tensor, head: nn.Module, index: Tensor, width: int, temperature: float) -> Tensor:
    z = head(hidden)[:, :width].float() / temperature
    return torch.log_softmax(z, dim=-1).gather(-1, index)


def student_logprobs_at(hidden: Tensor, head: nn.Module, index: Tensor, *, width: int | None = None,
                        temperature: float = 1.0, chunk_size: int | str | None = "auto") -> Tensor:
    """``[n, k]`` fp32: the student's log-probs of the tokens ``index`` (``[n, k]``) at each of its
    hidden rows ``[n, H]``, normalised over the first ``width`` columns of ``head``'s output (all
    when None), with a gradient to ``hidden`` and ``head``. A plain ``nn.Linear`` head is read a
    vocabulary slice at a time within one and a half chunks of ``[chunk, width]`` fp32
    (``chunk_size`` rows, ``"auto"`` as :func:`~lightning_mem.logits.rows_per_chunk`; None: all
    rows); any other is called a chunk of rows at a time, each chunk an activation checkpoint."""
    width = width or head.weight.shape[0]
    index = index.long()
    n = hidden.shape[0]
    spec = SliceSpec(Divergence("forward_kl"), float(temperature), width, rows_per_chunk(chunk_size, n, width),
                 index.shape[-1])
    if fusable(head):
        return _LogprobsAt.apply(hidden, head.weight, head.bias, index, spec)
    parts = []
    for start in range(0, max(n, 1), spec.rows):
        h, i = hidden[start : start + spec.rows], index[start : start + spec.rows]
        if torch.is_grad_enabled():
            parts.append(checkpoint(_module_rows, h, head, i, width, spec.temperature, use_reentrant=False))
        else:
            parts.append(_module_rows(h, head, i, width, spec.temperature))
    return torch.cat(parts)


def _with_tail(logprobs: Tensor) -> Tensor:
    """``[n, k + 1]``: the ``k`` log-probs and the log of the rest's mass, ``log(1 - sum p)`` (at
    least the smallest normal fp32, as the sum of fp32 probabilities can round to 1)."""
    covered = torch.logsumexp(logprobs, dim=-1, keepdim=True).clamp(max=0.0)
    rest = torch.log((-torch.expm1(covered)).clamp(min=torch.finfo(torch.float32).tiny))
    return torch.cat([logprobs, rest], dim=-1)


def top_k_divergence(student: Tensor, teacher: Tensor, divergence: Divergence, *, tail: bool = True) -> Tensor:
    """``[n]``: each row's divergence of the student from the teacher over the teacher's top-k
    tokens and the tail (module docstring), from both models' full-normalised log-probs at those
    tokens (``[n, k]`` each; ``student`` with its gradient). ``tail=False`` when the ``k`` tokens
    are the whole vocabulary compared."""
    if tail:
        student, teacher = _with_tail(student), _with_tail(teacher)
    return logprob_divergence(student, teacher, divergence)
