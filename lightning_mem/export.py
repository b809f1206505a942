"""Write a trained model in Hugging Face format, whatever strategy trained it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lightning_mem.checkpointing import staged_directory


def gather_full_state_dict(trainer: Any, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """The model's full (unsharded) state dict on CPU on rank 0, None on other ranks.

    A strategy that shards parameters provides ``full_state_dict(module)`` (a collective: every
    rank must call it); otherwise the module's own tensors are complete on every rank.
    """
    strategy = trainer.strategy
    if hasattr(strategy, "full_state_dict"):
        state = strategy.full_state_dict(model)
    else:
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    return state if trainer.is_global_zero else None


def export_hf(trainer: Any, model: torch.nn.Module, tokenizer: Any, out_dir: str | Path) -> None:
    """Save ``model`` (a ``PreTrainedModel``, or a peft model: adapters only) and the tokenizer to ``out_dir``."""
    state = gather_full_state_dict(trainer, model)
    if state is not None:
        # Written beside out_dir and renamed into place: a failed export leaves the previous one
        # (or nothing), never a folder with a config and no weights.
        with staged_directory(out_dir) as out:
            model.save_pretrained(out, state_dict=state, safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(out)
    trainer.strategy.barrier("export_hf")
