"""What Ulysses attention holds that one process running the whole sequence does not.

The estimate runs a context-parallel config as one process over whole sequences and divides the
activations by the context-parallel size (:func:`~lightning_mem.estimate.sharding.shard_per_rank`).
Measured against the real 2-rank fits (the tracker's live tensors at each rank's peak), that
division misses what the all-to-all exchanges of :func:`lightning_mem.context_parallel.ulysses_attention`
allocate:

- the attention output traded back to this rank's slice is a new tensor, which the output
  projection saves for backward while the kernel keeps its own output (an SDPA or flash-attention
  output is already laid out ``[B, T, heads, D]``, so in one process the projection saves a view
  of it): one more attention-output-sized tensor per layer whose activations are kept (the
  plain division was 3.4 % under the tiny GRPO update's real peak, 2.3 % under SFT's);
- while an exchange runs, its staged parts (``torch.stack``) and the received buffer beside its
  input and its joined result, in forward and again in backward (the reverse exchange).

So the estimate's one-process run goes through the same allocations: :func:`use_ulysses_footprint`
switches a model's attention to a wrapper that passes query, key, value and the output through
:class:`_Exchange` -- the three copies of one exchange, shape kept -- around the model's own
kernel. The copies are whole-sequence here and ``1/cp`` per rank after the division, as the real
ones are. Generation in the real run takes the plain kernel (no sequence layout is passed), so the
wrapper does too while ``active()`` says no.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from lightning_mem.context_parallel import KERNEL_KWARGS


def _exchange_copies(x: Tensor) -> Tensor:
    """One exchange's allocations: the staged parts, the received buffer, the joined result."""
    staged = x.contiguous().clone()
    received = torch.empty_like(staged).copy_(staged)
    return received.clone()


class _Exchange(torch.autograd.Function):
    """An all-to-all's memory in one process: forward and backward each make the exchange's copies."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return _exchange_copies(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return _exchange_copies(grad)


def ulysses_footprint_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                                attention_mask: Tensor | None, *, kernel: str, active: Callable[[], bool],
                                **kwargs: Any) -> tuple[Tensor, None]:
    """A ``transformers`` attention function: ``kernel`` with the Ulysses exchanges' copies around it."""
    from transformers import AttentionInterface

    inner = AttentionInterface()[kernel]
    if not active():
        return inner(module, query, key, value, attention_mask, **kwargs)
    q, k, v = (_Exchange.apply(t) for t in (query, key, value))
    # Called as Ulysses calls it: causal over the whole sequence, no padding mask (so no mask saved,
    # and grouped key/value heads are not repeated to the query heads as SDPA does under a mask).
    kernel_kwargs = {name: kwargs[name] for name in KERNEL_KWARGS if name in kwargs}
    out, _ = inner(module, q, k, v, None, is_causal=True, **kernel_kwargs)
    return _Exchange.apply(out), None


def _footprint_mask(*args: Any, mask: Callable[..., Any], active: Callable[[], bool], **kwargs: Any) -> Any:
    # The split model is given no padding mask (the kernel is causal over the whole sequence): no
    # [B, 1, T, T] mask is built, as in the run.
    return None if active() else mask(*args, **kwargs)


def use_ulysses_footprint(model: nn.Module, active: Callable[[], bool]) -> None:
    """Switch ``model`` (a ``transformers`` model) to its kernel with the exchanges' copies, as
    :func:`lightning_mem.context_parallel.attach_layout` switches it to Ulysses in the real run."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    kernel = getattr(model.config, "_attn_implementation", None) or "sdpa"
    kernel = "sdpa" if kernel == "eager" else kernel.removeprefix("ulysses_")
    name = f"ulysses_footprint_{kernel}"
    # Registered again for every run: ``active`` is this run's.
    AttentionInterface.register(name, partial(ulysses_footprint_attention, kernel=kernel, active=active))
    AttentionMaskInterface.register(name, partial(_footprint_mask, mask=ALL_MASK_ATTENTION_FUNCTIONS[kernel],
                                                  active=active))
    model.set_attn_implementation(name)
