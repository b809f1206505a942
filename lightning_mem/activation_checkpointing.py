"""Activation checkpointing: recompute a block's activations in backward instead of keeping them.

One implementation for every path that checkpoints: the :class:`~lightning_mem.callbacks.ActivationCheckpointing`
callback (single device, DDP), the FSDP2 strategy (before it shards each block) and the QLoRA recipe.
It is PyTorch's composable, non-reentrant ``checkpoint``: it works through forward hooks, so module
names (and state-dict keys, and HF export) are unchanged, FSDP2 is built to compose with it, and it
recomputes correctly when no input of a block needs a gradient (frozen embeddings under LoRA).
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from lightning_mem.module_tree import default_block_classes, find_blocks

_MARK = "_lightning_mem_checkpointed"


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
    return getattr(block, _MARK, False)


def checkpoint_block(block: nn.Module) -> bool:
    """Make ``block`` recompute its activations in backward; False if it already does."""
    from torch.distributed._composable import checkpoint

    if is_checkpointed(block):
        return False
    checkpoint(block)
    setattr(block, _MARK, True)
    return True


def checkpoint_blocks(model: nn.Module, every: int = 1, block_classes: Iterable[str] | None = None) -> tuple[int, int]:
    """Checkpoint every ``every``-th decoder block of ``model`` (see :func:`checkpointed_indices`);
    returns ``(checkpointed, blocks)``.

    Raises:
        ValueError: ``model`` has no module of the block classes.
    """
    classes = list(block_classes or default_block_classes(model))
    blocks = find_blocks(model, classes)
    if not blocks:
        raise ValueError(f"`{type(model).__name__}` has no module of class {sorted(classes)} to checkpoint")
    chosen = checkpointed_indices(len(blocks), every)
    for i in chosen:
        checkpoint_block(blocks[i])
    return len(chosen), len(blocks)
