"""Which modules of a LightningModule FSDP2 shards, and in what units.

The plan is found, not written by the user: every Hugging Face model held by the
LightningModule (one for SFT; actor, critic, reference and reward for PPO) is sharded
per decoder block and then at its root, and any other module that holds parameters
(a value head, say) becomes a unit of its own so its gradients are reduced across ranks.

These are plain functions over ``nn.Module`` trees so they can be tested and reused
without a process group; ``FSDP2Strategy`` calls them from small, overridable steps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from torch import nn
from torch.distributed.tensor import DTensor


def _is_hf_model(module: nn.Module) -> bool:
    # Imported lazily: transformers takes seconds to import and the strategy is usable
    # (for non-HF modules) without it.
    from transformers import PreTrainedModel

    return isinstance(module, PreTrainedModel)


def outermost(root: nn.Module, predicate: Callable[[nn.Module], bool]) -> list[tuple[str, nn.Module]]:
    """The submodules of ``root`` (``root`` included) that satisfy ``predicate`` and are
    not inside another one that does, with their attribute paths."""
    found: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        if predicate(module):
            found.append((prefix, module))
            return
        for name, child in module.named_children():
            visit(f"{prefix}.{name}" if prefix else name, child)

    visit("", root)
    return found


def find_hf_models(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost ``transformers.PreTrainedModel`` submodules of ``root``, by name.

    "Outermost" because a composite HF model (an encoder-decoder, a model with a vision
    tower) is one model to shard, not several. A peft ``PeftModel`` is no
    ``PreTrainedModel``: the search walks through it to the base model inside, which is
    where the decoder blocks (and the LoRA adapters within them) live.
    """
    return outermost(root, _is_hf_model)


def default_block_classes(model: nn.Module) -> list[str]:
    """The class names HF itself never splits across devices: the model's decoder blocks."""
    names = getattr(model, "_no_split_modules", None) or []
    # transformers 5 turns the class attribute into a set at init; sort for a stable order.
    return sorted(names)


def find_blocks(model: nn.Module, class_names: Iterable[str]) -> list[nn.Module]:
    """Submodules of ``model`` whose class name is in ``class_names``, in forward order.

    A block nested inside another block is skipped: FSDP2 groups parameters by the
    outermost ``fully_shard`` call that reaches them, so sharding the inner one too would
    only split the outer block's all-gather in two.
    """
    wanted = set(class_names)
    blocks: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if type(child).__name__ in wanted:
                blocks.append(child)
            else:
                visit(child)

    visit(model)
    return blocks


def class_names_in(modules: Iterable[nn.Module]) -> set[str]:
    """Every class name that occurs in the given module trees."""
    return {type(sub).__name__ for module in modules for sub in module.modules()}


def _unmanaged_params(module: nn.Module, recurse: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
    # After ``fully_shard`` a managed parameter is a DTensor; anything else is a plain
    # tensor that each rank holds in full and that FSDP would never reduce.
    for name, param in module.named_parameters(recurse=recurse):
        if not isinstance(param, DTensor):
            yield name, param


def unsharded_modules(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """The largest submodules of ``root`` that hold parameters FSDP does not manage yet.

    Call it after the HF models are sharded. Each returned module can be sharded as one
    unit, because its forward runs through ``__call__`` (where FSDP's hooks live). The
    root itself is never returned: Lightning calls ``training_step``, not the root's
    ``forward``, so a unit at the root would never be all-gathered.

    Raises:
        ValueError: a trainable parameter sits directly on ``root`` or on a container
            that also holds sharded modules: no unit can own it without owning the
            sharded modules too, and left alone its gradient would differ per rank.
    """
    units: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, module: nn.Module, is_root: bool) -> None:
        if not any(True for _ in _unmanaged_params(module)):
            return
        if not is_root and not any(isinstance(p, DTensor) for p in module.parameters()):
            units.append((prefix, module))
            return
        loose = [
            f"{prefix}.{name}" if prefix else name
            for name, param in _unmanaged_params(module, recurse=False)
            if param.requires_grad
        ]
        if loose:
            raise ValueError(
                f"FSDP2Strategy cannot shard the trainable parameter(s) {loose}: they sit directly on"
                f" `{type(module).__name__}` next to sharded modules, so their gradients would not be"
                " reduced across ranks. Move them into a submodule (e.g. an `nn.Linear` head) or freeze them."
            )
        for name, child in module.named_children():
            visit(f"{prefix}.{name}" if prefix else name, child, is_root=False)

    visit("", root, is_root=True)
    return units


def checkpointed_indices(num_blocks: int, every: int) -> list[int]:
    """Indices of the blocks to checkpoint when checkpointing every ``every``-th block.

    Counting from the first block (``every=2`` checkpoints blocks 0, 2, 4, ...), so that
    ``every=1`` is all blocks and any ``every`` checkpoints the first block, whose saved
    activations are alive longest. ``every=0`` checkpoints none.
    """
    if every <= 0:
        return []
    return list(range(0, num_blocks, every))
