"""Find things in a LightningModule's module tree: the Hugging Face models it holds, their decoder
blocks, the outermost modules that match a rule.

Plain functions over ``nn.Module`` trees, shared by the FSDP2 strategy (what it shards), the
activation-checkpointing primitive (what it recomputes) and the memory estimator.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from torch import nn


def is_hf_model(module: nn.Module) -> bool:
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
    return outermost(root, is_hf_model)


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
