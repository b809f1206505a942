"""Consolidating a sharded module's weights for export (e.g. HF ``save_pretrained``).

Sharded training checkpoints are the strategy's business (Lightning saves one shard per
rank); this is the other direction: one full copy of a model, on rank 0, on the host.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def full_state_dict(module: nn.Module, *, trainable_only: bool = False) -> dict[str, Tensor]:
    """The whole, unsharded state dict of ``module``, gathered to rank 0 on the host.

    A collective: every rank must call it. Rank 0 gets plain CPU tensors under the
    module's own keys (so ``module.save_pretrained(path, state_dict=sd)`` writes a normal
    HF checkpoint); the other ranks get ``{}``. Only one tensor is gathered at a time, so
    rank 0 needs host memory for the result, not device memory for the model.

    Args:
        module: a sharded (or plain) module, e.g. the HF model or the peft model.
        trainable_only: skip frozen parameters: for LoRA, only the adapters are
            gathered and the base model is not moved at all.
    """
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        # No process group: nothing is sharded, the local state dict is the full one.
        frozen = {name for name, param in module.named_parameters() if not param.requires_grad}
        return {
            name: tensor.detach().cpu()
            for name, tensor in module.state_dict().items()
            if not (trainable_only and name in frozen)
        }
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # cpu_offload=True: each tensor is gathered on the device, then moved to the host, and
    # only rank 0 keeps it.
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
    return get_model_state_dict(module, options=options)
