"""The logits path: per-token log-probs, cross-entropy and entropy without a ``[tokens, vocab]`` tensor.

For a modern vocabulary (128k-152k tokens) the output layer's logits, not the weights, decide
whether a step fits: ``[tokens, vocab]`` in bf16 is 1.2 GB for 4,096 tokens at vocab 151,936, and
the usual path makes several copies of it (a gathered copy, a temperature-scaled copy, fp32 copies
for log-softmax and entropy, their gradients). This module computes what a recipe needs from the
logits *inside the model's forward*, chunk by chunk:

- only the **scored positions** (label tokens in SFT, response tokens in PPO) reach the output
  layer: their final hidden states are gathered (``[n, hidden]``) and everything else is skipped;
- the positions run ``chunk_size`` at a time (``"auto"``: from the vocabulary and the number of
  positions, :func:`rows_per_chunk`); each chunk's logits are upcast to fp32, divided by the
  temperature, reduced to a log-prob of the target (and optionally the entropy), and freed before
  the next chunk.

Two ways through the output layer:

- **fused** (:func:`fused_logprobs`), for a plain ``nn.Linear`` head: its weight is read directly,
  cast to the compute dtype (autocast's) **once in the forward**, whatever the chunk count, and
  its gradient is written once. With one chunk and no entropy (SFT's cross-entropy) the gradients
  are computed in the forward and backward only scales them; otherwise backward recomputes the
  logits in vocabulary slices over all rows, each slice's transient within one and a half chunks
  of fp32 logits (so lowering ``chunk_size`` lowers the backward's peak too), casting each slice
  of the weight once more (no compute-dtype copy
  is kept from forward to backward: it would sit at the step's peak). Lightning's bf16-mixed autocast runs
  with its cast cache off, so calling the head per chunk (and again per recompute) cast the fp32
  weight twice per chunk and its gradient once per chunk, plus an fp32 add per chunk.
- **module call**, for any other head (LoRA-wrapped, 4-bit, a DTensor or ZeRO-3 partition, a
  separately FSDP-sharded layer, a layer with hooks): the layer is called as a module for every
  chunk, each chunk a non-reentrant activation checkpoint, so whatever a strategy hangs on it
  works unchanged (ZeRO-3 gathers the weight around each call).

How it reaches inside the forward: the model's output layer (``get_output_embeddings()``) is
swapped, for the length of one call, for a :class:`ScoredOutputLayer` that returns these per-token
results in place of logits. FSDP2 has the root unit's parameters (embeddings, final norm, output
layer) unsharded plain tensors during the forward and gathers them again before the backward that
reaches them, so the fused path reads them there. Because the results are the model's forward
output, a strategy's backward hooks on that output fire as they would for logits.

``chunk_size=None`` (or 0) runs all scored positions as one chunk: the unchunked path (through a
module call, plain autograd with the logits kept for backward).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, Union

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lightning_mem.context_parallel import gather_scattered, layout_of, shard_sequences
from lightning_mem.settings import SettingError

#: Config attributes of model families whose forward transforms the logits after the output
#: layer (soft-capping, scaling): the chunked path would apply that transform to its results.
_LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


#: A chunk-size setting, as a recipe's constructor annotates it (the CLI parses ``auto``, a count
#: and ``null``): ``"auto"``, rows per chunk, or 0/None for one chunk. :func:`check_chunk_size` says
#: what else is refused (a negative count).
ChunkSize = Union[int, Literal["auto"], None]


def check_chunk_size(value: Any, *, key: str = "chunk_size") -> int | str | None:
    """``value`` as the logits path takes it: ``"auto"`` (:func:`rows_per_chunk` picks the rows),
    a positive int (rows per chunk), or None for 0 and None (one chunk: the unchunked path).

    One rule for every caller: the recipes call it on ``model.logits_chunk_size`` (``key``) before
    any model loads.

    Raises:
        SettingError: naming ``key``, for anything else (a negative count, another string, a bool).
    """
    if value is None or value == "auto":
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SettingError(key, f" must be 'auto', a positive int (rows per chunk), or 0 or null (one chunk),"
                                f" got {value!r}")
    return int(value) or None


@dataclass
class TokenScores:
    """Per-token results at the scored positions, in the order the positions were given."""

    logprobs: Tensor  # [n] fp32: log p(target | prefix) at the given temperature
    entropy: Tensor | None  # [n] fp32, when asked for
    hidden: Tensor | None  # [n, hidden] final hidden states of the scored positions, when asked for
    extra: Tensor | None = None  # what ``score_tokens``' ``extra`` computed from them, when given


def chunked_logprobs(
    hidden: Tensor,
    targets: Tensor,
    output_layer: nn.Module,
    *,
    chunk_size: int | str | None = "auto",
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    grad_in_forward: bool | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``(logprobs [n], entropy [n] or None)`` of ``targets`` given final hidden states ``[n, H]``.

    ``entropy_grad=False`` computes the entropy outside the autograd graph (a metric).
    ``chunk_size``: see :func:`rows_per_chunk`. A plain ``nn.Linear`` output layer takes the fused
    path (:func:`fused_logprobs`, ``grad_in_forward`` as there); any other is called as a module,
    a chunk at a time, each chunk an activation checkpoint.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if fusable(output_layer):
        return fused_logprobs(hidden, targets, output_layer.weight, output_layer.bias, chunk_size=chunk_size,
                              temperature=temperature, with_entropy=with_entropy, entropy_grad=entropy_grad,
                              grad_in_forward=grad_in_forward)
    n = hidden.shape[0]
    vocab = getattr(output_layer, "out_features", None)
    if chunk_size == "auto" and not vocab:
        chunk_size = 512  # a layer that does not say its width: the old default
    step = rows_per_chunk(chunk_size, n, vocab or 1)
    recompute = bool(chunk_size) and torch.is_grad_enabled() and (hidden.requires_grad or _has_trainable(output_layer))
    logprobs, entropies = [], []
    for start in range(0, n, step):
        h, t = hidden[start : start + step], targets[start : start + step]
        if recompute:
            lp, ent = checkpoint(
                _score_chunk, h, t, output_layer, temperature, with_entropy, entropy_grad, use_reentrant=False
            )
        else:
            lp, ent = _score_chunk(h, t, output_layer, temperature, with_entropy, entropy_grad)
        logprobs.append(lp)
        entropies.append(ent)
    if not logprobs:
        # Nothing scored here (a context-parallel rank whose slice holds no label): the output
        # layer still runs, on no rows, so that its parameters get a (zero) gradient on this rank
        # too: FSDP reduce-scatters a unit's gradients together, and a rank without them would
        # send a shorter buffer than its peers.
        logprobs, entropy = _score_chunk(hidden, targets, output_layer, temperature, with_entropy, entropy_grad)
        return logprobs.clone(), (entropy.clone() if entropy is not None else None)  # fresh tensors, as below
    # cat even of one chunk: a fresh tensor, not a view (a strategy hooks the forward's outputs,
    # and FSDP2 warns that an in-place op on a returned view would bypass its backward hook).
    return torch.cat(logprobs), (torch.cat(entropies) if with_entropy else None)


def _has_trainable(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


def _score_chunk(
    h: Tensor, t: Tensor, output_layer: nn.Module, temperature: float, with_entropy: bool, entropy_grad: bool
) -> tuple[Tensor, Tensor | None]:
    # fp32 log-softmax of one chunk; the compute-dtype logits die as soon as they are upcast, and
    # log_softmax keeps only its result for backward, so one [chunk, vocab] fp32 tensor is alive.
    logits = output_layer(h).float()
    if temperature != 1.0:
        logits.div_(temperature)  # in place: no second copy for the temperature
    logp = torch.log_softmax(logits, dim=-1)
    del logits
    picked = logp.gather(-1, t.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            source = logp if entropy_grad else logp.detach()
            # A dot product per row: no [chunk, vocab] product beside p itself.
            entropy = -torch.linalg.vecdot(source.exp(), source)
    return picked, entropy


# ---------------------------------------------------------------------------------------------
# The fused path: the output layer's weight once per step
# ---------------------------------------------------------------------------------------------

#: Logit elements per ``[rows, vocab]`` slice that ``chunk_size="auto"`` allows (256 MiB in fp32;
#: 441 rows at a 151,936-token vocabulary, the whole micro-batch below 2**26 / vocab rows).
AUTO_CHUNK_ELEMENTS = 2**26

#: Logit elements per ``[rows, vocabulary slice]`` of the recomputing backward at most (128 MiB in
#: fp32, with its 64 MiB compute-dtype copy). It runs while the weight's gradient (fp32) and every
#: saved activation are alive, the step's peak: at the Qwen2.5-0.5B architecture with 8 x 1,024
#: tokens, 2**26 put the estimated peak 0.19 GiB higher (docs/benchmarks.md). A smaller chunk
#: narrows the slice further (:func:`backward_slice_width`).
BACKWARD_SLICE_ELEMENTS = 2**25


def backward_slice_width(n: int, vocab: int, hidden: int, rows: int, *, compute_bytes: int,
                         weight_copy_bytes: int, entropy: bool) -> int:
    """Vocabulary columns per slice of the recomputing backward over ``n`` rows.

    A user lowers ``chunk_size`` (``rows``) to fit: the backward's transient must fall with it, to
    at most one and a half chunks of fp32 logits (``rows x vocab x 4`` bytes). Beside the slice, the
    backward holds two ``[n, hidden]`` tensors in the compute dtype (the rows' cast, a slice's
    product with the weight); each column of a slice holds ``n`` fp32 logits turned into their
    gradient in place, their compute-dtype copy (``compute_bytes``, 0 in fp32), the probabilities
    under an entropy gradient, and a row of the weight (``weight_copy_bytes``: its cast and the
    gradient product before its cast). Narrower than needed costs time (many small products).
    At most :data:`BACKWARD_SLICE_ELEMENTS` logits a slice, at least one column.
    """
    chunk = min(rows, n) * vocab * 4
    beside = 2 * n * hidden * (compute_bytes or 4)
    budget = max(chunk * 3 // 2 - beside, chunk)  # a chunk too small for the rows' own tensors: one chunk
    per_column = n * (4 + compute_bytes + (4 if entropy else 0)) + hidden * weight_copy_bytes
    width = min(budget // max(per_column, 1), BACKWARD_SLICE_ELEMENTS // max(n, 1), vocab)
    return max(1, width)


def rows_per_chunk(chunk_size: int | str | None, rows: int, vocab: int) -> int:
    """Rows per chunk for ``rows`` scored positions at ``vocab`` (at least 1).

    ``None`` or 0: all rows at once (unchunked). A number: that many rows. ``"auto"``: as few
    chunks as keep each chunk's logits within :data:`AUTO_CHUNK_ELEMENTS`, evened out over the
    rows, so a problem that fits that budget is one chunk.
    """
    chunk_size = check_chunk_size(chunk_size)
    if chunk_size == "auto":
        chunks = max(1, -(-rows * vocab // AUTO_CHUNK_ELEMENTS))
        return max(1, -(-rows // chunks))
    return max(1, rows if not chunk_size else int(chunk_size))


def fusable(output_layer: nn.Module) -> bool:
    """Whether the fused path may read ``output_layer``'s weight directly instead of calling it.

    Only a plain ``nn.Linear`` (not a subclass: FSDP2 turns a separately sharded layer into
    ``FSDPLinear``, peft into ``lora.Linear``, bitsandbytes into ``Linear4bit``) with no hooks of
    its own (DeepSpeed ZeRO-3 and tensor parallelism gather or redistribute around the call) and
    plain-tensor parameters (not a DTensor shard, not a ZeRO-3 partition). Under FSDP2 the root
    unit's output layer qualifies: its parameters are unsharded plain tensors during the forward.
    """
    if type(output_layer) is not nn.Linear:
        return False
    if output_layer._forward_hooks or output_layer._forward_pre_hooks or output_layer._backward_hooks:
        return False
    for p in output_layer.parameters():
        if hasattr(p, "ds_id"):  # a DeepSpeed ZeRO-3 partition
            return False
        if _is_fake(p):  # the estimator's fake tensors stand for plain ones
            continue
        if type(p) not in (nn.Parameter, torch.Tensor) or type(p.data) is not torch.Tensor:
            return False
    return True


def _is_fake(t: Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _compute_dtype(weight: Tensor) -> torch.dtype:
    # What F.linear would multiply in: autocast's dtype when autocast is on for this device.
    device = weight.device.type
    if weight.is_floating_point() and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return weight.dtype


def _logits(h: Tensor, w: Tensor, b: Tensor | None, temperature: float) -> Tensor:
    """fp32 logits of one slice, divided by the temperature; ``h``/``w``/``b`` in the compute dtype."""
    z = (h @ w.T if b is None else torch.addmm(b, h, w.T)).float()
    if temperature != 1.0:
        z.div_(temperature)
    return z


def _softmax(z: Tensor, t: Tensor, lse_out: Tensor, logprob_out: Tensor, *, probs: bool,
             log_probs: bool) -> tuple[Tensor | None, Tensor | None]:
    """Reduce one chunk's fp32 logits ``z`` (overwritten): each row's log-sum-exp and its target's
    log-prob go into the two ``_out`` rows; returns ``(softmax(z) if probs, log_softmax(z) if
    log_probs)``.

    Without the log-probs, ``z`` becomes the probabilities in place: one ``[rows, vocab]`` tensor
    alive, where ``logsumexp`` (its own temporary) and then an ``exp`` held two or three at once.
    """
    top = z.amax(-1, keepdim=True)
    picked = z.gather(-1, t.unsqueeze(-1)).squeeze(-1)
    z.sub_(top)
    p = z.exp() if log_probs else z.exp_()
    total = p.sum(-1, keepdim=True)
    log_total = total.log()
    if log_probs:
        z.sub_(log_total)
    if probs:
        p.div_(total)
    lse = (top + log_total).squeeze(-1)
    lse_out.copy_(lse)
    logprob_out.copy_(picked - lse)
    return (p if probs else None), (z if log_probs else None)


class _FusedScores(torch.autograd.Function):
    """``(logprobs [n], entropy [n])`` of ``targets`` under ``softmax(hidden @ weight.T + bias) / T``.

    Forward runs token chunks from one compute-dtype copy of the weight, freed when it returns.
    Each chunk's logits are reduced in place (:func:`_softmax`). Two ways to the gradients:

    - **in the forward** (``eager``): the gradient of ``sum(logprobs)`` w.r.t. the logits and the
      hidden rows is computed while the logits exist; the logits gradient (one chunk, compute
      dtype) is kept, and backward makes the weight's from it in one product, the upstream scale
      folded into the hidden rows. That is the gradient whenever the
      upstream gradient is the same for every token (a sum times a scale, as in SFT's loss):
      backward checks that structurally (a gradient expanded from a scalar has stride 0, no host
      sync; ``mean()``'s backward divides it into a new tensor and is not recognized) and only
      scales the stored gradients by it. No chunk runs twice. Anything else falls back to the
      recompute below: always the exact gradient, at worst one logits product more.
    - **recomputed in the backward** otherwise (per-token upstream gradients: PPO's ratio, an
      entropy bonus): the logits are recomputed in vocabulary slices over all rows from each
      slice of the weight (cast again) and the saved log-sum-exp, and each slice of the weight
      gradient is written once.

    Either way the weight is cast once in the forward (and once more, a slice at a time, by a
    recomputing backward), and in one chunk (or recomputed) its gradient
    is materialized once: no per-chunk cast of a ``[vocab, hidden]`` gradient, no per-chunk fp32
    add into ``.grad``. (Forced ``eager`` over several chunks accumulates one fp32 buffer, one
    add per chunk; :func:`fused_logprobs` does not choose that by itself.)
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, rows, with_entropy, entropy_grad, eager):
        dtype = _compute_dtype(weight)
        with torch.autocast(weight.device.type, enabled=False):
            w = weight.to(dtype)  # the forward's one cast (a no-op when the weight is in it already)
            b = bias.to(dtype) if bias is not None else None
            n, vocab = hidden.shape[0], weight.shape[0]
            logprobs = hidden.new_empty(n, dtype=torch.float32)
            lse = hidden.new_empty(n, dtype=torch.float32)
            entropy = hidden.new_empty(n if with_entropy else 0, dtype=torch.float32)
            want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
            want_b = bias is not None and ctx.needs_input_grad[2]
            eager = eager and n > 0 and (want_h or want_w or want_b)
            dh = dw = db = dl = None
            if eager:
                dh = hidden.new_empty(hidden.shape, dtype=dtype) if want_h else None
                multi = n > rows
                db = weight.new_zeros(vocab, dtype=torch.float32) if want_b else None
            for start in range(0, n, rows):
                stop = min(start + rows, n)
                h = hidden[start:stop].to(dtype)
                t = targets[start:stop]
                p, logp = _softmax(_logits(h, w, b, temperature), t, lse[start:stop], logprobs[start:stop],
                                   probs=eager or with_entropy, log_probs=with_entropy)
                if with_entropy:
                    entropy[start:stop] = -torch.linalg.vecdot(p, logp)
                del logp
                if not eager:
                    continue
                # d sum(logprobs) / d logits = (onehot(target) - p) / T, rows of this chunk.
                grad = p.neg_()
                grad.scatter_add_(-1, t.unsqueeze(-1), grad.new_ones(stop - start, 1))
                if temperature != 1.0:
                    grad.div_(temperature)
                if db is not None:
                    db.add_(grad.sum(0))
                grad = grad.to(dtype)
                if dh is not None:
                    torch.mm(grad, w, out=dh[start:stop])
                if want_w and not multi:
                    # One chunk: its (compute-dtype) logits gradient is kept, and backward makes the
                    # weight gradient from it with the upstream scale folded into the small hidden
                    # rows: one product written once in the weight's dtype, as F.linear's backward.
                    dl = grad
                elif want_w:
                    part = grad.T @ h
                    if dw is None:
                        dw = part.float()  # forced over several chunks: one fp32 accumulator
                    else:
                        dw.add_(part)
                del grad, p
        if not with_entropy or not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        ctx.temperature, ctx.dtype, ctx.rows = temperature, dtype, rows
        ctx.entropy_grad = with_entropy and entropy_grad
        ctx.eager = (dh, dw, db, dl) if eager else None
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy if with_entropy else None)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        want_b = bias is not None and ctx.needs_input_grad[2]
        eager, ctx.eager = ctx.eager, None
        if not ctx.entropy_grad:
            g_ent = None  # a metric (or not asked for): zeros at most
        if eager is not None and g_ent is None and _uniform(g_lp):
            scale = g_lp.reshape(-1)[0]
            dh, dw, db, dl = eager
            gh = torch.mul(dh, scale).to(hidden.dtype) if want_h else None
            gw = None
            if want_w and dl is not None:
                with torch.autocast(weight.device.type, enabled=False):
                    gw = (dl.T @ torch.mul(hidden, scale).to(ctx.dtype)).to(weight.dtype)
            elif want_w:
                gw = _scaled(dw, scale, weight.dtype)
            gb = _scaled(db, scale, bias.dtype) if want_b else None
            return gh, gw, gb, None, None, None, None, None, None
        del eager
        return (*_recomputed_grads(hidden, weight, bias, targets, lse, entropy, g_lp, g_ent, ctx.temperature,
                                   ctx.dtype, ctx.rows, (want_h, want_w, want_b)),
                None, None, None, None, None, None)


def _uniform(g: Tensor) -> bool:
    # The gradient of a sum or mean reaches here expanded from a scalar: stride 0 (or one row).
    return g.dim() == 1 and g.numel() > 0 and (g.numel() == 1 or g.stride(0) == 0)


def _scaled(grad: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    if grad.dtype == dtype:
        return grad.mul_(scale)
    out = torch.empty(grad.shape, dtype=dtype, device=grad.device)
    return torch.mul(grad, scale, out=out)  # scaled and cast in one pass


def _recomputed_grads(hidden, weight, bias, targets, lse, entropy, g_lp, g_ent, temperature, dtype, rows, wants):
    """Gradients w.r.t. hidden, weight and bias for per-token upstream gradients, in vocabulary
    slices over all rows (as wide as one chunk of ``rows`` allows, :func:`backward_slice_width`):
    each slice's logits are made again from that slice of the weight, cast to the compute dtype
    here (the forward keeps no compute-dtype copy of the weight for backward), and each slice of the
    weight gradient is written once (no accumulation over chunks)."""
    want_h, want_w, want_b = wants
    n, vocab = hidden.shape[0], weight.shape[0]
    with torch.autocast(weight.device.type, enabled=False):
        h = hidden.to(dtype)
        gh = hidden.new_zeros(hidden.shape, dtype=torch.float32) if want_h else None
        gw = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device) if want_w else None
        gb = torch.empty(vocab, dtype=bias.dtype, device=weight.device) if want_b else None
        size = torch.empty((), dtype=dtype).element_size()
        width = backward_slice_width(
            n, vocab, weight.shape[1], rows, compute_bytes=0 if dtype == torch.float32 else size,
            weight_copy_bytes=(size if weight.dtype != dtype else 0) + (size if want_w and weight.dtype != dtype else 0),
            entropy=g_ent is not None)
        g_lp = g_lp.float().unsqueeze(-1)
        for start in range(0, vocab, width):
            stop = min(start + width, vocab)
            w = weight[start:stop].to(dtype)
            logp = _logits(h, w, None if bias is None else bias[start:stop].to(dtype), temperature)
            logp.sub_(lse.unsqueeze(-1))
            if g_ent is not None:
                p = logp.exp()
                # dH/dz = -p (log p + H), H the entropy; z the tempered logits.
                grad = logp.add_(entropy.unsqueeze(-1)).mul_(p).mul_(-g_ent.float().unsqueeze(-1))
                grad.sub_(p.mul_(g_lp))
                del p
            else:
                grad = logp.exp_().mul_(-g_lp)  # in place: one [rows, slice] fp32 tensor alive
            del logp
            inside = (targets >= start) & (targets < stop)
            # d logp_t / dz = onehot(t) - p: the onehot part of the rows whose target is in this slice
            grad.scatter_add_(-1, (targets - start).clamp(0, stop - start - 1).unsqueeze(-1),
                              g_lp * inside.unsqueeze(-1))
            if temperature != 1.0:
                grad.div_(temperature)
            if gb is not None:
                gb[start:stop] = grad.sum(0)
            grad = grad.to(dtype)
            if gh is not None:
                gh.add_(grad @ w)
            if gw is not None and gw.dtype == dtype:
                torch.mm(grad.T, h, out=gw[start:stop])  # straight into the gradient: no copy
            elif gw is not None:
                gw[start:stop] = grad.T @ h  # the slice's share of the one cast to the weight's dtype
            del grad, w
    return (gh.to(hidden.dtype) if gh is not None else None), gw, gb


def fused_logprobs(hidden: Tensor, targets: Tensor, weight: Tensor, bias: Tensor | None = None, *,
                   chunk_size: int | str | None = "auto", temperature: float = 1.0, with_entropy: bool = False,
                   entropy_grad: bool = True, grad_in_forward: bool | None = None) -> tuple[Tensor, Tensor | None]:
    """:func:`chunked_logprobs` on an output layer's ``weight`` (and ``bias``) directly.

    ``grad_in_forward``: compute the gradients of ``sum(logprobs)`` in the forward (see
    :class:`_FusedScores`). None (the default) does so when no entropy is asked for (a
    cross-entropy loss, whose upstream gradient is uniform) and the positions are one chunk;
    with several chunks the weight gradient would be accumulated once per chunk, and measured on
    CPU that costs more than the backward's extra logits product (docs/benchmarks.md).
    """
    rows = rows_per_chunk(chunk_size, hidden.shape[0], weight.shape[0])
    if grad_in_forward is None:
        grad_in_forward = not with_entropy and rows >= hidden.shape[0]
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias))
    logprobs, entropy = _FusedScores.apply(hidden, weight, bias, targets, temperature, rows, with_entropy,
                                           entropy_grad, grad_in_forward and needs_grad)
    return logprobs, (entropy if with_entropy else None)


# ---------------------------------------------------------------------------------------------
# Inside the model's forward
# ---------------------------------------------------------------------------------------------


class ScoredOutputLayer(nn.Module):
    """Stands in for a causal LM's output layer during one forward.

    It receives the final hidden states ``[B, T, H]`` the model would project to logits, gathers
    the rows at ``positions`` (flat indices ``b * T + t``), and returns a tuple
    ``(logprobs, entropy, hidden, extra)`` of :class:`TokenScores` fields in place of logits.
    """

    def __init__(
        self,
        output_layer: nn.Module,
        positions: Tensor,
        targets: Tensor,
        *,
        chunk_size: int | str | None,
        temperature: float,
        with_entropy: bool,
        entropy_grad: bool,
        with_hidden: bool,
        extra: Callable[[Tensor, nn.Module], Tensor] | None = None,
    ) -> None:
        super().__init__()
        # Kept out of the module tree (a plain attribute, not a submodule): the real layer stays
        # registered where it was, under its own name, for strategies and state dicts.
        object.__setattr__(self, "output_layer", output_layer)
        self.positions, self.targets = positions, targets
        self.chunk_size, self.temperature = chunk_size, temperature
        self.with_entropy, self.entropy_grad, self.with_hidden = with_entropy, entropy_grad, with_hidden
        self.extra = extra

    def forward(self, hidden_states: Tensor) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
        hidden = hidden_states.reshape(-1, hidden_states.shape[-1]).index_select(0, self.positions)
        logprobs, entropy = chunked_logprobs(
            hidden,
            self.targets,
            self.output_layer,
            chunk_size=self.chunk_size,
            temperature=self.temperature,
            with_entropy=self.with_entropy,
            entropy_grad=self.entropy_grad,
        )
        extra = self.extra(hidden, self.output_layer) if self.extra is not None else None
        return logprobs, entropy, (hidden if self.with_hidden else None), extra


def causal_lm_of(model: nn.Module) -> nn.Module:
    """The ``transformers`` causal LM inside ``model`` (itself, or the base of a peft model)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def check_supported(model: nn.Module, *, key: str = "chunk_size") -> None:
    """Raise when ``model``'s forward post-processes logits (the chunked path would corrupt them).

    ``key`` names the chunk-size setting to switch off (:func:`score_tokens`' ``chunk_size``; a
    recipe passes its own, ``model.logits_chunk_size``).
    """
    lm = causal_lm_of(model)
    config = getattr(lm, "config", None)
    found = [name for name in _LOGIT_POSTPROCESSING if getattr(config, name, None) not in (None, 1, 1.0)]
    if found:
        raise ValueError(
            f"{type(lm).__name__} transforms its logits after the output layer ({', '.join(found)}), which the chunked"
            f" logits path does not reproduce: set `{key}: null` for this model"
        )
    if not callable(getattr(lm, "get_output_embeddings", None)) or lm.get_output_embeddings() is None:
        raise ValueError(f"{type(lm).__name__} has no output layer (`get_output_embeddings()`); is it a causal LM?")


@contextlib.contextmanager
def _output_layer_replaced(lm: nn.Module, replacement: nn.Module) -> Iterator[nn.Module]:
    original = lm.get_output_embeddings()
    owner, name = _owner_of(lm, original)
    # Swapped without nn.Module.__setattr__'s bookkeeping being left behind: restored below.
    owner._modules[name] = replacement
    try:
        yield original
    finally:
        owner._modules[name] = original


def _owner_of(root: nn.Module, target: nn.Module) -> tuple[nn.Module, str]:
    for module in root.modules():
        for name, child in module._modules.items():
            if child is target:
                return module, name
    raise ValueError(f"the output layer of {type(root).__name__} is not one of its submodules")


def score_tokens(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    positions: Tensor,
    targets: Tensor,
    *,
    chunk_size: int | str | None = "auto",
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    with_hidden: bool = False,
    position_ids: Tensor | None = None,
    extra: Callable[[Tensor, nn.Module], Tensor] | None = None,
) -> TokenScores:
    """Run ``model`` on a right- or left-padded batch and score ``targets`` at ``positions``.

    A packed row (:mod:`lightning_mem.data.packing`) comes with ``position_ids`` restarting per
    example and ``attention_mask=None``: the model then isolates the examples.

    Args:
        model: a ``transformers`` causal LM, or a peft model wrapping one (adapters as they are
            now: enabled, or disabled inside ``disable_adapter()``).
        positions: ``[n]`` flat indices ``b * T + t`` of the positions whose output predicts a
            target (for next-token prediction, the position *before* the target token).
        targets: ``[n]`` the token ids scored at those positions.
        chunk_size: positions per chunk through the output layer (:func:`rows_per_chunk`):
            ``"auto"`` picks it from the vocabulary and the number of positions (one chunk when
            their logits fit :data:`AUTO_CHUNK_ELEMENTS`); None or 0: one chunk, no
            recomputation (the unchunked path).
        temperature: logits are divided by it before the softmax (PPO scores the sampling
            distribution).
        with_entropy, entropy_grad: the entropy of each position's distribution, with or
            without a gradient.
        with_hidden: also return the gathered final hidden states (a shared value head reads them).
        extra: ``extra(hidden rows [n, H], output layer) -> Tensor``, computed inside the forward,
            where the output layer is what the forward uses (a sharding strategy has its weight
            whole there, as FSDP2's root unit does) and the result's backward passes the strategy's
            hooks as the log-probs' does; returned as :attr:`TokenScores.extra` (a distillation
            divergence, :mod:`lightning_mem.distillation`).
    """
    check_supported(model)
    options = dict(chunk_size=chunk_size or None, temperature=temperature, with_entropy=with_entropy,
                   entropy_grad=entropy_grad, with_hidden=with_hidden, extra=extra)
    layout = layout_of(model)
    if layout is None:
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if position_ids is not None:
            inputs["position_ids"] = position_ids
        return _scored_forward(model, inputs, positions, targets, options)
    if position_ids is not None:
        # The slices' positions come from the attention mask; restarting (packed) ones would be lost.
        raise ValueError("packed rows (`data.packing`) are not split by tensor or context parallelism yet: "
                         "turn one of them off")
    return _scored_split_forward(model, input_ids, attention_mask, positions, targets, layout, options)


def _scored_split_forward(model: nn.Module, input_ids: Tensor, attention_mask: Tensor | None, positions: Tensor,
                          targets: Tensor, layout, options: dict) -> TokenScores:  # noqa: ANN001
    """:func:`score_tokens` under a strategy's split (lightning_mem.context_parallel): this rank runs
    its slice of each sequence, scores the positions in it, and the group's results are gathered in order."""
    shard = shard_sequences(input_ids, attention_mask, layout)
    width = input_ids.shape[1]
    inputs = {"input_ids": shard.input_ids, "position_ids": shard.position_ids}
    if layout.context_parallel:
        inputs["sequence_layout"] = layout  # read by the Ulysses attention function
    else:  # one slice: the whole (padded) sequence, padding masked as given
        inputs["attention_mask"] = torch.nn.functional.pad(attention_mask, (0, shard.width - width))
    local = shard.local_positions(positions, width)
    scores = _scored_forward(model, inputs, local, targets[shard.owners(positions, width) == layout.rank], options)
    if not layout.context_parallel:
        return scores
    owners = shard.owners(positions, width)
    return TokenScores(*(gather_scattered(value, owners, layout)
                         for value in (scores.logprobs, scores.entropy, scores.hidden, scores.extra)))


def _scored_forward(model: nn.Module, inputs: dict[str, Tensor], positions: Tensor, targets: Tensor,
                    options: dict) -> TokenScores:
    lm = causal_lm_of(model)
    head = ScoredOutputLayer(lm.get_output_embeddings(), positions, targets, **options)
    with _output_layer_replaced(lm, head):
        out = model(**inputs, use_cache=False)
    scores = out.logits if hasattr(out, "logits") else out[0]
    if not isinstance(scores, tuple) or len(scores) != 4:
        raise ValueError(
            f"{type(lm).__name__}'s forward changed the output layer's result before returning it; the chunked"
            " logits path cannot be used with this model: set `chunk_size: null`"
        )
    return TokenScores(*scores)


class _HiddenRows(nn.Module):
    """Stands in for the output layer: returns the final hidden states at ``positions``, ``[n, hidden]``."""

    def __init__(self, positions: Tensor) -> None:
        super().__init__()
        self.positions = positions

    def forward(self, hidden_states: Tensor) -> Tensor:
        return hidden_states.reshape(-1, hidden_states.shape[-1]).index_select(0, self.positions)


def hidden_states_at(model: nn.Module, input_ids: Tensor, attention_mask: Tensor | None, positions: Tensor, *,
                     position_ids: Tensor | None = None) -> Tensor:
    """``[n, hidden]``: the final hidden states ``model``'s output layer would read at ``positions``
    (flat indices ``b * T + t``), its output layer skipped (a distillation teacher's forward: the
    loss applies the output layer itself, a chunk at a time). Arguments as :func:`score_tokens`."""
    check_supported(model)  # a model that post-processes its logits cannot be read this way either
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    if position_ids is not None:
        inputs["position_ids"] = position_ids
    lm = causal_lm_of(model)
    with _output_layer_replaced(lm, _HiddenRows(positions)):
        out = model(**inputs, use_cache=False)
    return out.logits if hasattr(out, "logits") else out[0]


def next_token_targets(input_ids: Tensor, labels: Tensor, ignore_index: int = -100) -> tuple[Tensor, Tensor]:
    """``(positions, targets)`` for next-token cross-entropy: position ``t`` predicts ``labels[t + 1]``
    wherever that label is not ``ignore_index`` (the shift ``transformers`` applies to ``labels``)."""
    shifted = labels[:, 1:]
    rows, cols = (shifted != ignore_index).nonzero(as_tuple=True)
    width = input_ids.shape[1]
    return rows * width + cols, shifted[rows, cols]


def response_targets(prompt_lengths: Tensor, response_ids: Tensor, response_mask: Tensor, width: int,
                     *, starts: Tensor | None = None,
                     response_lengths: list[int] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """``(positions, targets, (rows, cols))`` of each real response token of right-padded sequences
    whose response starts at ``prompt_lengths``: response token j of sample i is predicted at
    position ``prompt_lengths[i] - 1 + j``. ``(rows, cols)`` place the results back into ``[N, R]``.

    ``starts``: where each sequence begins in the flat input when it is not row ``i`` of ``width``
    columns (``i * width``), as in a packed row (:func:`lightning_mem.data.packing.pack_right_padded`).
    ``response_lengths``: each response's tokens, known on the host (its mask is a prefix of its row):
    ``(rows, cols)`` are then built there, and nothing waits for the device to find them."""
    if response_lengths is None:
        rows, cols = response_mask.nonzero(as_tuple=True)
    else:
        host_rows = torch.repeat_interleave(torch.arange(len(response_lengths)), torch.tensor(response_lengths, dtype=torch.long),
                                            output_size=sum(response_lengths))
        starts_of = torch.tensor([0, *response_lengths[:-1]], dtype=torch.long).cumsum(0)
        host_cols = torch.arange(host_rows.numel()) - starts_of[host_rows]
        device = response_mask.device
        both = torch.stack([host_rows, host_cols])
        # From pinned memory the copy is queued behind the work before it instead of waiting for it.
        both = both.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else both.to(device)
        rows, cols = both[0], both[1]
    begins = rows * width if starts is None else starts[rows]
    positions = begins + prompt_lengths[rows] - 1 + cols
    return positions, response_ids[rows, cols], (rows, cols)
