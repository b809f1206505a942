"""Which modules of a LightningModule FSDP2 shards, and in what units.

The plan is found, not written by the user: every Hugging Face model held by the
LightningModule (one for SFT; actor, critic, reference and reward for PPO) is sharded
per decoder block and then at its root, and any other module that holds parameters
(a value head, say) becomes a unit of its own so its gradients are reduced across ranks.

These are plain functions over ``nn.Module`` trees so they can be tested and reused
without a process group; ``FSDP2Strategy`` calls them from small, overridable steps.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn
from torch.distributed.tensor import DTensor


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
