"""The logits path: per-token log-probs, cross-entropy and entropy without a ``[tokens, vocab]`` tensor.

For a modern vocabulary (128k-152k tokens) the output layer's logits, not the weights, decide
whether a step fits: ``[tokens, vocab]`` in bf16 is 1.2 GB for 4,096 tokens at vocab 151,936, and
the usual path makes several copies of it (a gathered copy, a temperature-scaled copy, fp32 copies
for log-softmax and entropy, their gradients). This module computes what a recipe needs from the
logits *inside the model's forward*, chunk by chunk:

- only the **scored positions** (label tokens in SFT, response tokens in PPO) reach the output
  layer: their final hidden states are gathered (``[n, hidden]``) and everything else is skipped;
- the output layer runs on ``chunk_size`` positions at a time; each chunk's logits are upcast to
  fp32, divided by the temperature in place, reduced to a log-prob of the target (and optionally
  the entropy), and freed before the next chunk;
- with gradients, each chunk is a non-reentrant activation checkpoint: backward **recomputes** that
  chunk's logits instead of keeping them, so at most one chunk's logits are alive in forward or in
  backward.

How it reaches inside the forward: the model's output layer (``get_output_embeddings()``) is
swapped, for the length of one call, for a :class:`ScoredOutputLayer` that returns these per-token
results in place of logits. The output layer is still *called* as a module for every chunk, so
whatever a strategy hangs on it works unchanged: FSDP2 has the root unit's parameters (embeddings,
final norm, output layer) gathered during the forward and gathers them again before the backward
that reaches them; DeepSpeed ZeRO-3 gathers the layer's weight around each call; a LoRA-wrapped or
4-bit model keeps its own (possibly adapted) output layer. Because the results are the model's
forward output, a strategy's backward hooks on that output fire as they would for logits.

``chunk_size=None`` (or 0) runs all scored positions as one chunk with ordinary autograd (the
logits of the scored positions are kept for backward): the unchunked reference path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lightning_mem.context_parallel import gather_scattered, layout_of, shard_sequences

#: Config attributes of model families whose forward transforms the logits after the output
#: layer (soft-capping, scaling): the chunked path would apply that transform to its results.
_LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


@dataclass
class TokenScores:
    """Per-token results at the scored positions, in the order the positions were given."""

    logprobs: Tensor  # [n] fp32: log p(target | prefix) at the given temperature
    entropy: Tensor | None  # [n] fp32, when asked for
    hidden: Tensor | None  # [n, hidden] final hidden states of the scored positions, when asked for


def chunked_logprobs(
    hidden: Tensor,
    targets: Tensor,
    output_layer: nn.Module,
    *,
    chunk_size: int | None = 512,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """``(logprobs [n], entropy [n] or None)`` of ``targets`` given final hidden states ``[n, H]``.

    ``entropy_grad=False`` computes the entropy outside the autograd graph (a metric).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    n = hidden.shape[0]
    step = n if not chunk_size else int(chunk_size)
    recompute = bool(chunk_size) and torch.is_grad_enabled() and (hidden.requires_grad or _has_trainable(output_layer))
    logprobs, entropies = [], []
    for start in range(0, n, max(step, 1)):
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
# Inside the model's forward
# ---------------------------------------------------------------------------------------------


class ScoredOutputLayer(nn.Module):
    """Stands in for a causal LM's output layer during one forward.

    It receives the final hidden states ``[B, T, H]`` the model would project to logits, gathers
    the rows at ``positions`` (flat indices ``b * T + t``), and returns a tuple
    ``(logprobs, entropy, hidden)`` of :class:`TokenScores` fields in place of logits.
    """

    def __init__(
        self,
        output_layer: nn.Module,
        positions: Tensor,
        targets: Tensor,
        *,
        chunk_size: int | None,
        temperature: float,
        with_entropy: bool,
        entropy_grad: bool,
        with_hidden: bool,
    ) -> None:
        super().__init__()
        # Kept out of the module tree (a plain attribute, not a submodule): the real layer stays
        # registered where it was, under its own name, for strategies and state dicts.
        object.__setattr__(self, "output_layer", output_layer)
        self.positions, self.targets = positions, targets
        self.chunk_size, self.temperature = chunk_size, temperature
        self.with_entropy, self.entropy_grad, self.with_hidden = with_entropy, entropy_grad, with_hidden

    def forward(self, hidden_states: Tensor) -> tuple[Tensor, Tensor | None, Tensor | None]:
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
        return logprobs, entropy, (hidden if self.with_hidden else None)


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
    chunk_size: int | None = 512,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    with_hidden: bool = False,
    position_ids: Tensor | None = None,
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
        chunk_size: positions per chunk through the output layer; None or 0: one chunk, no
            recomputation (the unchunked path).
        temperature: logits are divided by it before the softmax (PPO scores the sampling
            distribution).
        with_entropy, entropy_grad: the entropy of each position's distribution, with or
            without a gradient.
        with_hidden: also return the gathered final hidden states (a shared value head reads them).
    """
    check_supported(model)
    options = dict(chunk_size=chunk_size or None, temperature=temperature, with_entropy=with_entropy,
                   entropy_grad=entropy_grad, with_hidden=with_hidden)
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
    # Split by a strategy (lightning_mem.context_parallel): this rank runs its slice of each
    # sequence, scores the positions in it, and the group's results are gathered in order.
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
    return TokenScores(*(gather_scattered(value, owners, layout) for value in (scores.logprobs, scores.entropy, scores.hidden)))


def _scored_forward(model: nn.Module, inputs: dict[str, Tensor], positions: Tensor, targets: Tensor,
                    options: dict) -> TokenScores:
    lm = causal_lm_of(model)
    head = ScoredOutputLayer(lm.get_output_embeddings(), positions, targets, **options)
    with _output_layer_replaced(lm, head):
        out = model(**inputs, use_cache=False)
    scores = out.logits if hasattr(out, "logits") else out[0]
    if not isinstance(scores, tuple) or len(scores) != 3:
        raise ValueError(
            f"{type(lm).__name__}'s forward changed the output layer's result before returning it; the chunked"
            " logits path cannot be used with this model: set `chunk_size: null`"
        )
    return TokenScores(*scores)


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
