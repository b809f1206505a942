"""Divergences between a student's and a teacher's next-token distributions, a vocabulary slice at a time.

Logit distillation compares two ``[tokens, vocab]`` distributions per scored position. At a 152k
vocabulary the usual way (both models' logits, their fp32 upcasts, log-softmaxes, products and
their gradients: NeMo RL #3495, verl #6593) holds many ``[tokens, vocab]`` fp32 tensors. Here
both models' **final hidden states** at the scored positions come in (``[n, H_s]`` with a
gradient, ``[n, H_t]`` without) with their output layers, and each output layer is applied a
slice of the vocabulary at a time (the student's with its gradient, the teacher's without), upcast
to fp32 per slice, divided by the temperature:

1. a first pass keeps each row's running log-sum-exp for both models (and, with ``top_k``, the
   teacher's running top-k and the student's logits there);
2. a second pass sums each row's divergence from the normalised log-probs; with ``top_k`` the
   ``[n, k]`` terms need no second pass;
3. backward recomputes each slice from the saved log-sum-exps and per-row sums, and writes the
   gradient of the student's hidden rows, output weight (and bias) slice by slice.

A slice is as wide as one and a half chunks of ``[chunk, vocab]`` fp32 logits allow over all
``n`` rows (``chunk_size`` rows, or ``"auto"`` as :func:`lightning_mem.logits.rows_per_chunk`),
counting every transient a slice makes (:func:`slice_width`): no ``[tokens, vocab]`` tensor of
either model exists. An output layer that is not a plain ``nn.Linear`` (LoRA-wrapped, 4-bit, a
DTensor) is called as a module instead, a chunk of rows at a time, each chunk an activation
checkpoint (:func:`reference_rows` on its logits): correct, but several chunks of fp32 at once.

The divergences, per position, with ``p`` the student's and ``q`` the teacher's distribution:

- ``forward_kl``: KL(q || p) = sum q (log q - log p) (torchtune's ``ForwardKLLoss`` computes
  -sum q log p, which differs by the teacher's entropy: the same gradient);
- ``reverse_kl``: KL(p || q) (on-policy distillation's direction);
- ``jsd``: TRL GKD's generalized Jensen-Shannon divergence, beta KL(q || m) + (1 - beta) KL(p || m)
  with m = beta q + (1 - beta) p. As in TRL, ``beta`` 0 and 1 are forward and reverse KL exactly;
  the formula itself tends to 0 at both ends (it divided by ``beta`` tends to forward KL as
  beta -> 0, divided by ``1 - beta`` to reverse KL as beta -> 1).

``top_k`` (NeMo RL's ``topk_logits_k``): the sum runs over the teacher's ``k`` most likely tokens of
each position only, with both models' log-probs normalised over the whole vocabulary (neither is
renormalised over the ``k``; NeMo RL's ``DistillationLossFn`` by default renormalises both over
them, and with ``zero_outside_topk`` keeps the student's full normaliser). The on-policy dense
signal adds the tail as one outcome instead (:mod:`.topk`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lightning_mem.logits import fusable, rows_per_chunk

DivergenceKind = Literal["forward_kl", "reverse_kl", "jsd"]
KINDS: tuple[str, ...] = ("forward_kl", "reverse_kl", "jsd")

#: fp32 bytes per ``[row, column]`` a slice holds at its peak, by divergence (measured on fake
#: tensors: the second pass and the backward hold the two log-probs and two more at most).
_SLICE_FP32_BYTES = {"forward_kl": 12, "reverse_kl": 12, "jsd": 16}


@dataclass(frozen=True)
class Divergence:
    """Which divergence (``kind``) and, for ``jsd``, its ``beta`` in [0, 1]."""

    kind: str = "forward_kl"
    beta: float = 0.5

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"divergence must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"beta must be in [0, 1], got {self.beta}")

    @property
    def resolved(self) -> str:
        """The kind computed: TRL's ``jsd`` at beta 0 is forward KL and at beta 1 reverse KL."""
        if self.kind == "jsd" and self.beta in (0.0, 1.0):
            return "forward_kl" if self.beta == 0.0 else "reverse_kl"
        return self.kind

    def _mixture(self, ls: Tensor, lt: Tensor) -> Tensor:
        """log m = log((1 - beta) p + beta q), stable where both are tiny (a new tensor)."""
        lm = ls + math.log1p(-self.beta)
        return torch.logaddexp(lm, lt + math.log(self.beta), out=lm)

    def terms(self, ls: Tensor, lt: Tensor) -> tuple[Tensor, Tensor]:
        """``(f, g)`` per element: the divergence's terms and their derivative by ``ls``.

        The divergence of a position is ``f.sum(-1)``; its gradient by the student's logits is
        ``(g - p * g.sum(-1)) / temperature``. Allocating: for the ``[n, k]`` top-k terms.
        """
        kind = self.resolved
        if kind == "forward_kl":
            q = lt.exp()
            return q * (lt - ls), -q
        p = ls.exp()
        if kind == "reverse_kl":
            return p * (ls - lt), p * (ls - lt + 1)
        lm = self._mixture(ls, lt)
        student = p * (ls - lm)
        return self.beta * lt.exp() * (lt - lm) + (1 - self.beta) * student, (1 - self.beta) * student

    def row_sums(self, ls: Tensor, lt: Tensor) -> tuple[Tensor, Tensor]:
        """``(f.sum(-1), g.sum(-1))`` of one vocabulary slice, computed in place (``ls`` and ``lt``
        are overwritten): at most four ``[rows, slice]`` fp32 tensors at once."""
        kind = self.resolved
        if kind == "forward_kl":
            q = lt.exp()
            value = torch.linalg.vecdot(q, lt.sub_(ls))
            return value, -q.sum(-1)
        if kind == "reverse_kl":
            p = ls.exp()
            value = torch.linalg.vecdot(p, ls.sub_(lt))
            return value, value + p.sum(-1)
        lm = self._mixture(ls, lt)
        teacher = torch.linalg.vecdot(lt.exp(), lt.sub_(lm))
        del lt
        p = ls.exp()
        student = torch.linalg.vecdot(p, ls.sub_(lm))
        return self.beta * teacher + (1 - self.beta) * student, (1 - self.beta) * student

    def slice_grad(self, ls: Tensor, lt: Tensor, g_sum: Tensor) -> Tensor:
        """``g - p * g_sum`` of one slice (by the tempered student logits), in place."""
        kind = self.resolved
        g_sum = g_sum.unsqueeze(-1)
        if kind == "forward_kl":  # -q - p * g_sum
            return ls.exp_().mul_(-g_sum).sub_(lt.exp_())
        if kind == "reverse_kl":  # p (ls - lt + 1 - g_sum)
            p = ls.exp()
            return ls.sub_(lt).sub_(g_sum - 1).mul_(p)
        lm = self._mixture(ls, lt)  # p ((1 - beta)(ls - lm) - g_sum)
        del lt
        p = ls.exp()
        return ls.sub_(lm).mul_(1 - self.beta).sub_(g_sum).mul_(p)


def reference_rows(student_logits: Tensor, teacher_logits: Tensor, divergence: Divergence, *,
                   temperature: float = 1.0, top_k: int | None = None) -> Tensor:
    """The divergence of each row from whole ``[rows, vocab]`` logits with plain autograd (TRL's
    formulation): what the sliced path must equal, and the module-call path's per-chunk loss."""
    upcast = torch.promote_types(student_logits.dtype, torch.float32)  # fp32 at least (float64 stays)
    ls = torch.log_softmax(student_logits.to(upcast) / temperature, dim=-1)
    lt = torch.log_softmax(teacher_logits.to(upcast) / temperature, dim=-1)
    if top_k:
        index = lt.topk(top_k, dim=-1).indices
        ls, lt = ls.gather(-1, index), lt.gather(-1, index)
    return logprob_divergence(ls, lt, divergence)


def logprob_divergence(ls: Tensor, lt: Tensor, divergence: Divergence) -> Tensor:
    """``[...]``: the divergence summed over the last dimension of the student's and the teacher's
    log-probs ``ls`` and ``lt`` (plain autograd: for ``[rows, k]`` tensors, or whole rows in a test)."""
    kind = divergence.resolved
    if kind == "forward_kl":
        return (lt.exp() * (lt - ls)).sum(-1)
    if kind == "reverse_kl":
        return (ls.exp() * (ls - lt)).sum(-1)
    beta = divergence.beta
    mixture = torch.logsumexp(torch.stack([ls + math.log(1 - beta), lt + math.log(beta)]), dim=0)
    return (beta * lt.exp() * (lt - mixture) + (1 - beta) * ls.exp() * (ls - mixture)).sum(-1)


@dataclass(frozen=True)
class SliceSpec:
    divergence: Divergence
    temperature: float
    width: int  # vocabulary columns compared (the shared tokenizer's, :mod:`.vocabulary`)
    rows: int  # rows of one chunk: the memory budget of a slice
    top_k: int


def slice_width(n: int, spec: SliceSpec, student_hidden: int, teacher_hidden: int, *, student_bytes: int,
                teacher_bytes: int) -> int:
    """Vocabulary columns per slice over ``n`` rows: what one and a half chunks of ``[rows, width]``
    fp32 logits hold, less what sits beside the slices (the rows' compute-dtype casts, the top-k
    state). A column costs its fp32 terms (:data:`_SLICE_FP32_BYTES`), both products before their
    upcast, and a column of each weight cast (and of the student's weight gradient). At least
    ``top_k`` columns (a slice's top-k), at most the whole width."""
    if n == 0:
        return spec.width
    chunk = min(spec.rows, n) * spec.width * 4
    beside = n * (student_hidden * student_bytes + teacher_hidden * teacher_bytes) + n * spec.top_k * 24
    budget = max(chunk * 3 // 2 - beside, chunk // 2)
    per_column = n * (_SLICE_FP32_BYTES[spec.divergence.resolved] + student_bytes + teacher_bytes)
    per_column += 2 * student_hidden * max(student_bytes, 4) + teacher_hidden * max(teacher_bytes, 4)
    return max(spec.top_k, 1, min(budget // max(per_column, 1), spec.width))


def compute_dtype(weight: Tensor) -> torch.dtype:
    device = weight.device.type
    if weight.is_floating_point() and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return weight.dtype


def slice_logits(h: Tensor, w: Tensor, b: Tensor | None, start: int, stop: int, dtype: torch.dtype,
                 temperature: float) -> Tensor:
    """fp32 logits of columns ``[start, stop)`` divided by the temperature; the slice of the
    weight is cast to ``dtype`` here, so no compute-dtype copy of a whole weight is ever kept."""
    ws = w[start:stop].to(dtype)
    z = (h @ ws.T if b is None else torch.addmm(b[start:stop].to(dtype), h, ws.T)).float()
    return z.div_(temperature) if temperature != 1.0 else z


class RunningLogSumExp:
    """Each row's log-sum-exp over the slices seen so far (consumes each slice in place)."""

    def __init__(self, n: int, device: torch.device) -> None:
        self.top = torch.full((n,), -math.inf, device=device)
        self.total = torch.zeros(n, device=device)

    def add(self, z: Tensor) -> None:
        top = torch.maximum(self.top, z.amax(-1))
        self.total.mul_(torch.exp(self.top - top)).add_(z.sub_(top.unsqueeze(-1)).exp_().sum(-1))
        self.top = top

    def value(self) -> Tensor:
        return self.top + self.total.log()


class _RunningTopK:
    """The teacher's ``k`` largest logits of each row so far, their columns and the student's logits there."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.teacher: Tensor | None = None

    def add(self, zt: Tensor, zs: Tensor, start: int) -> None:
        teacher, index = zt.topk(min(self.k, zt.shape[-1]), dim=-1)
        student, index = zs.gather(-1, index), index + start
        if self.teacher is not None:
            teacher, order = torch.cat([self.teacher, teacher], -1).topk(self.k, dim=-1)
            index = torch.cat([self.index, index], -1).gather(-1, order)
            student = torch.cat([self.student, student], -1).gather(-1, order)
        self.teacher, self.index, self.student = teacher, index, student


class _SlicedDivergence(torch.autograd.Function):
    """Per-row divergence ``[n]`` from both models' hidden rows and output weights (see the module
    docstring); the teacher's inputs never get a gradient."""

    @staticmethod
    def forward(ctx, hs, ws, bs, ht, wt, bt, spec: SliceSpec):
        n, div, temp = hs.shape[0], spec.divergence, spec.temperature
        ds, dt = compute_dtype(ws), compute_dtype(wt)
        with torch.autocast(ws.device.type, enabled=False):
            hsc, htc = hs.to(ds), ht.to(dt)
            width = slice_width(n, spec, hs.shape[1], ht.shape[1], student_bytes=extra_bytes(ds), teacher_bytes=extra_bytes(dt))
            lse_s, lse_t = RunningLogSumExp(n, hs.device), RunningLogSumExp(n, hs.device)
            top = _RunningTopK(spec.top_k) if spec.top_k else None
            for start in range(0, spec.width, width):
                stop = min(start + width, spec.width)
                zs = slice_logits(hsc, ws, bs, start, stop, ds, temp)
                zt = slice_logits(htc, wt, bt, start, stop, dt, temp)
                if top is not None:
                    top.add(zt, zs, start)
                lse_s.add(zs)
                lse_t.add(zt)
                del zs, zt
            lse_s, lse_t = lse_s.value(), lse_t.value()
            if top is not None:  # the [n, k] terms at the teacher's top-k
                terms, g = div.terms(top.student - lse_s.unsqueeze(-1), top.teacher - lse_t.unsqueeze(-1))
                value, g_sum, index, g_top = terms.sum(-1), g.sum(-1), top.index, g
            else:
                value, g_sum = torch.zeros(n, device=hs.device), torch.zeros(n, device=hs.device)
                index = g_top = None
                for start in range(0, spec.width, width):
                    stop = min(start + width, spec.width)
                    ls = slice_logits(hsc, ws, bs, start, stop, ds, temp).sub_(lse_s.unsqueeze(-1))
                    lt = slice_logits(htc, wt, bt, start, stop, dt, temp).sub_(lse_t.unsqueeze(-1))
                    part, g = div.row_sums(ls, lt)
                    value.add_(part)
                    g_sum.add_(g)
                    del ls, lt
        ctx.spec, ctx.width, ctx.dtypes = spec, width, (ds, dt)
        ctx.save_for_backward(hs, ws, bs, ht, wt, bt, lse_s, lse_t, g_sum, index, g_top)
        return value

    @staticmethod
    def backward(ctx, upstream):
        hs, ws, bs, ht, wt, bt, lse_s, lse_t, g_sum, index, g_top = ctx.saved_tensors
        spec, width, (ds, dt) = ctx.spec, ctx.width, ctx.dtypes
        scale = (upstream.float() / spec.temperature).unsqueeze(-1)
        with torch.autocast(ws.device.type, enabled=False):
            htc = ht.to(dt) if index is None else None

            def slice_grad(ls: Tensor, start: int, stop: int) -> Tensor:
                if index is None:
                    lt = slice_logits(htc, wt, bt, start, stop, dt, spec.temperature).sub_(lse_t.unsqueeze(-1))
                    return spec.divergence.slice_grad(ls, lt, g_sum).mul_(scale)
                return top_k_slice_grad(ls, index, g_top, g_sum, start, stop).mul_(scale)

            gh, gw, gb = student_grads(hs, ws, bs, lse_s, ctx.needs_input_grad[:3], spec.width, width, ds,
                                       spec.temperature, slice_grad)
        return gh, gw, gb, None, None, None, None


def top_k_slice_grad(ls: Tensor, index: Tensor, g_top: Tensor, g_sum: Tensor, start: int, stop: int) -> Tensor:
    """``g - p * g_sum`` of one slice (in place of ``ls``, the slice's student log-probs) where ``g``
    is ``g_top`` at the ``index`` columns (``[n, k]``) and 0 elsewhere: the gradient by the
    tempered logits of a function of the student's log-probs at ``index`` alone."""
    grad = ls.exp_().mul_(-g_sum.unsqueeze(-1))
    inside = (index >= start) & (index < stop)
    return grad.scatter_add_(-1, (index - start).clamp(0, stop - start - 1), g_top * inside)


def student_grads(hs: Tensor, ws: Tensor, bs: Tensor | None, lse_s: Tensor, wanted: tuple[bool, ...], total: int,
                  width: int, ds: torch.dtype, temperature: float,
                  slice_grad: Callable[[Tensor, int, int], Tensor]) -> tuple[Tensor | None, ...]:
    """The gradients of the student's hidden rows, output weight and bias (``wanted``: which), a
    vocabulary slice of ``width`` columns at a time over the first ``total``: each slice's log-probs
    recomputed from the saved log-sum-exps, ``slice_grad(ls, start, stop)`` its gradient by the
    logits (fp32, scaled), written into the weight's rows and summed into the hidden rows'."""
    want_h, want_w = wanted[0], wanted[1]
    want_b = bs is not None and wanted[2]
    hsc = hs.to(ds)
    gh = torch.zeros(hs.shape, dtype=torch.float32, device=hs.device) if want_h else None
    gw = torch.zeros_like(ws) if want_w else None
    gb = torch.zeros_like(bs) if want_b else None
    for start in range(0, total, width):
        stop = min(start + width, total)
        ls = slice_logits(hsc, ws, bs, start, stop, ds, temperature).sub_(lse_s.unsqueeze(-1))
        grad = slice_grad(ls, start, stop)
        del ls
        if gb is not None:
            gb[start:stop] = grad.sum(0)
        grad = grad.to(ds)
        if gh is not None:
            gh.add_(grad @ ws[start:stop].to(ds))
        if gw is not None:
            gw[start:stop] = grad.T @ hsc
        del grad
    return (gh.to(hs.dtype) if gh is not None else None), gw, gb


def extra_bytes(dtype: torch.dtype) -> int:
    """Bytes of a compute-dtype copy made beside fp32 (none when computing in fp32)."""
    return 0 if dtype == torch.float32 else torch.empty((), dtype=dtype).element_size()


def _module_chunk(hs: Tensor, ht: Tensor, student_head: nn.Module, teacher_head: nn.Module, spec: SliceSpec) -> Tensor:
    student = student_head(hs)[:, : spec.width]
    with torch.no_grad():
        teacher = teacher_head(ht)[:, : spec.width]
    return reference_rows(student, teacher, spec.divergence, temperature=spec.temperature, top_k=spec.top_k or None)


def distillation_divergence(student_hidden: Tensor, student_head: nn.Module, teacher_hidden: Tensor,
                            teacher_head: nn.Module, *, divergence: Divergence, temperature: float = 1.0,
                            width: int | None = None, top_k: int | None = None,
                            chunk_size: int | str | None = "auto") -> Tensor:
    """``[n]`` fp32: the divergence of the student's distribution from the teacher's at each row.

    Args:
        student_hidden: ``[n, H_s]`` final hidden states of the scored positions (with a gradient).
        student_head, teacher_head: the output layers (``get_output_embeddings()``). Plain
            ``nn.Linear`` layers are read slice by slice; any other is called as a module.
        teacher_hidden: ``[n, H_t]`` the teacher's, same positions, on the student's device.
        width: vocabulary columns compared: both layers' first ``width`` rows (a padded layer is
            cut to the shared tokenizer's size); None: the student's rows.
        top_k: sum over the teacher's ``top_k`` tokens only (module docstring); None or 0: all.
        chunk_size: rows of one ``[rows, vocab]`` fp32 chunk, the memory a slice may use
            (``"auto"``: :func:`~lightning_mem.logits.rows_per_chunk`); None or 0: all rows.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    width = width or student_head.weight.shape[0]
    top_k = int(top_k or 0)
    if top_k > width:
        raise ValueError(f"top_k ({top_k}) exceeds the vocabulary compared ({width})")
    n = student_hidden.shape[0]
    spec = SliceSpec(divergence, float(temperature), width, rows_per_chunk(chunk_size, n, width), top_k)
    if fusable(student_head) and fusable(teacher_head):
        return _SlicedDivergence.apply(student_hidden, student_head.weight, student_head.bias,
                                       teacher_hidden.detach(), teacher_head.weight.detach(),
                                       None if teacher_head.bias is None else teacher_head.bias.detach(), spec)
    parts = []
    for start in range(0, max(n, 1), spec.rows):
        hs, ht = student_hidden[start : start + spec.rows], teacher_hidden[start : start + spec.rows]
        if torch.is_grad_enabled():  # recomputed in backward: one chunk's logits at a time
            parts.append(checkpoint(_module_chunk, hs, ht, student_head, teacher_head, spec, use_reentrant=False))
        else:
            parts.append(_module_chunk(hs, ht, student_head, teacher_head, spec))
    return torch.cat(parts)
