"""Activation checkpointing: recompute a block's activations in backward instead of keeping them.

One implementation for every path that checkpoints: the :class:`~lightning_mem.callbacks.ActivationCheckpointing`
callback (single device, DDP), the FSDP2 strategy (before it shards each block) and the QLoRA recipe.
It is PyTorch's composable, non-reentrant ``checkpoint``: it works through forward hooks, so module
names (and state-dict keys, and HF export) are unchanged, FSDP2 is built to compose with it, and it
recomputes correctly when no input of a block needs a gradient (frozen embeddings under LoRA).

Three ways to trade less memory for recompute, per block (torchtitan and prime-rl offer the first two):

- ``policy="full"``: keep only the block's input; recompute everything in backward.
- ``policy="selective"``: an op-level save list on torch's selective-checkpoint API: the outputs of
  matmuls and attention (expensive to recompute) are kept, every pointwise op, norm and activation
  function (cheap, and most of the saved bytes in a decoder block) is recomputed.
- ``offload_inputs=True``: the one tensor a fully checkpointed block keeps, its input, goes to host
  memory until backward (:class:`~lightning_mem.activation_offload.ActivationOffloader`, entered
  around the checkpoint's own save of its inputs only). On CPU the copies happen but save nothing.

How many blocks to checkpoint: every k-th (``every``), the first n (``count``), or the fewest whose
estimated peak fits a device budget (:func:`blocks_within_budget`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
from torch import nn

from lightning_mem.module_tree import default_block_classes, find_blocks

_MARK = "_lightning_mem_checkpointed"

Policy = Literal["full", "selective"]
POLICIES = ("full", "selective")

#: Ops whose outputs selective checkpointing keeps: matmuls and attention, the FLOPs of a block.
#: Everything else (pointwise ops, norms, SiLU/GELU, softmax, rotary embeddings) is recomputed.
_MATMUL_OPS = ("mm", "addmm", "bmm", "baddbmm", "linear", "_scaled_dot_product_flash_attention",
               "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
               "_scaled_dot_product_flash_attention_for_cpu")
SAVED_OPS = frozenset(getattr(torch.ops.aten, name).default for name in _MATMUL_OPS if hasattr(torch.ops.aten, name))


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context() -> tuple[Any, Any]:
    """The forward and recompute contexts of the selective policy (``context_fn`` of a checkpoint)."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_save_matmuls)


def checkpointed_indices(num_blocks: int, every: int) -> list[int]:
    """Indices of the blocks to checkpoint when checkpointing every ``every``-th block.

    Counting from the first block (``every=2`` checkpoints blocks 0, 2, 4, ...), so that
    ``every=1`` is all blocks and any ``every`` checkpoints the first block, whose saved
    activations are alive longest. ``every=0`` checkpoints none.
    """
    if every <= 0:
        return []
    return list(range(0, num_blocks, every))


def is_checkpointed(block: nn.Module) -> bool:
    """Whether :func:`checkpoint_block` made ``block`` recompute its activations."""
    return bool(getattr(block, _MARK, False))


def checkpoint_block(block: nn.Module, policy: Policy = "full", offloader: Any = None) -> bool:
    """Make ``block`` recompute its activations in backward; False if it already does.

    ``policy``: ``"full"`` or ``"selective"`` (see the module). ``offloader``: an
    :class:`~lightning_mem.activation_offload.ActivationOffloader` that takes the block's saved
    input to the host (one offloader may serve every block of a model).
    """
    from torch.distributed._composable import checkpoint

    if policy not in POLICIES:
        raise ValueError(f"activation checkpointing policy must be one of {POLICIES}, got {policy!r}")
    if is_checkpointed(block):
        return False
    if offloader is not None:
        # Before checkpoint's own pre-hook, which saves the inputs through the saved-tensor hooks
        # active then (these) and only then installs its own for the inside of the block.
        block.register_forward_pre_hook(functools.partial(_enter_offload, offloader), prepend=True)
    checkpoint(block, context_fn=selective_context if policy == "selective" else None)
    if offloader is not None:
        # After checkpoint's forward hook (it prepends its own), so the hook stack unwinds in order.
        block.register_forward_hook(functools.partial(_exit_offload, offloader), always_call=True)
    setattr(block, _MARK, policy)
    return True


def recomputing(block: nn.Module) -> bool:
    """Whether ``block`` (checkpointed by :func:`checkpoint_block`) is running its recompute in backward.

    The recompute calls the block again, forward pre-hooks included: a hook that changes the
    block's input (sequence parallelism's slicing of the first block's input) would change it a
    second time. Composable ``checkpoint`` disables its own hook while it recomputes; that flag
    is the signal (False for a block that is not checkpointed).
    """
    from torch.distributed._composable import checkpoint

    return is_checkpointed(block) and not checkpoint.state(block).enable_hook


def _offloads_now(block: nn.Module) -> bool:
    # In backward, checkpoint re-runs the forward with its hook disabled: nothing to offload then.
    return torch.is_grad_enabled() and not recomputing(block)


def _enter_offload(offloader: Any, block: nn.Module, args: Any) -> None:
    if _offloads_now(block) and not offloader.active:
        offloader.__enter__()
        block._lightning_mem_offloading = True


def _exit_offload(offloader: Any, block: nn.Module, args: Any, output: Any) -> None:
    if getattr(block, "_lightning_mem_offloading", False):
        block._lightning_mem_offloading = False
        offloader.__exit__(None, None, None)


def checkpoint_blocks(
    model: nn.Module,
    every: int = 1,
    block_classes: Iterable[str] | None = None,
    *,
    count: int | None = None,
    policy: Policy = "full",
    offload_inputs: bool = False,
) -> tuple[int, int]:
    """Checkpoint every ``every``-th decoder block of ``model`` (see :func:`checkpointed_indices`),
    or its first ``count`` blocks; returns ``(checkpointed, blocks)``.

    Raises:
        ValueError: ``model`` has no module of the block classes.
    """
    classes = list(block_classes or default_block_classes(model))
    blocks = find_blocks(model, classes)
    if not blocks:
        raise ValueError(f"`{type(model).__name__}` has no module of class {sorted(classes)} to checkpoint")
    # The first blocks' activations live longest (saved first, freed last in backward): checkpoint those.
    chosen = list(range(min(count, len(blocks)))) if count is not None else checkpointed_indices(len(blocks), every)
    if policy == "selective" and chosen and getattr(getattr(model, "config", None), "use_cache", False):
        # Selective checkpointing replays the block's ops by position in backward: a KV cache that
        # the forward appended to would make the replay differ (Hugging Face training forwards
        # build one unless told not to). Generation asks for its cache explicitly.
        model.config.use_cache = False
    offloader = None
    if offload_inputs and chosen:
        from lightning_mem.activation_offload import ActivationOffloader

        offloader = ActivationOffloader()
        model._lightning_mem_input_offloader = offloader  # tests and stats read it
    for i in chosen:
        checkpoint_block(blocks[i], policy, offloader)
    return len(chosen), len(blocks)


def fewest_blocks_within(budget_bytes: int, peak_of: Callable[[int], int], num_blocks: int) -> tuple[int, dict[int, int]]:
    """The fewest blocks to checkpoint (the first n) whose peak ``peak_of(n)`` fits ``budget_bytes``;
    returns it and every peak it asked for.

    ``peak_of`` is an estimate (the recipe CLI passes the estimator's device peak of the run with n
    blocks checkpointed). Blocks are alike, so each saves about the same: the peaks with none and
    with all give the per-block saving, one more estimate checks the interpolated n, and n grows
    one block at a time only if that estimate is still over (a few estimates, not a search).

    Raises:
        ValueError: even with every block checkpointed the peak is over the budget.
    """
    peaks: dict[int, int] = {}

    def peak(n: int) -> int:
        if n not in peaks:
            peaks[n] = peak_of(n)
        return peaks[n]

    if peak(0) <= budget_bytes:
        return 0, peaks
    if peak(num_blocks) > budget_bytes:
        raise ValueError(
            f"with all {num_blocks} blocks checkpointed the estimated peak is {peak(num_blocks) / 2**30:.2f} GiB,"
            f" over the budget of {budget_bytes / 2**30:.2f} GiB: checkpointing alone cannot fit it"
        )
    per_block = max(1.0, (peak(0) - peak(num_blocks)) / num_blocks)
    n = min(num_blocks, max(1, math.ceil((peak(0) - budget_bytes) / per_block)))
    while n < num_blocks and peak(n) > budget_bytes:
        n += 1
    # The interpolation may overshoot by one where savings are uneven: the block before may fit too.
    while n > 1 and peak(n - 1) <= budget_bytes:
        n -= 1
    return n, peaks
