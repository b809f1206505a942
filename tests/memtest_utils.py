"""Tiny models, data and Lightning modules shared by the memory-technique tests."""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Optional

import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 512


def tiny_llama(seed: int = 0, layers: int = 4) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=256,
    )
    return LlamaForCausalLM(config)


def checkpoint_blocks(model: nn.Module) -> nn.Module:
    """Non-reentrant activation checkpointing on every decoder block (what the strategies do)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, LlamaDecoderLayer),
    )
    return model


def token_batches(n: int, batch: int = 2, seq: int = 64, seed: int = 1) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, seq), generator=generator) for _ in range(n)]


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


class TinyLM(LightningModule):
    """The tiny Llama trained on random tokens; ``manual=True`` runs ``passes`` forward/backward
    passes and ``steps_per_batch`` optimizer steps per batch, as PPO does."""

    def __init__(
        self,
        optimizer: Callable[[Any], torch.optim.Optimizer] = adamw,
        checkpointing: bool = False,
        manual: bool = False,
        passes: int = 1,
        steps_per_batch: int = 1,
        batches_per_epoch: int = 8,
    ) -> None:
        super().__init__()
        self.batches_per_epoch = batches_per_epoch
        self.model = tiny_llama()
        if checkpointing:
            checkpoint_blocks(self.model)
        self.optimizer_factory = optimizer
        self.automatic_optimization = not manual
        self.passes = passes
        self.steps_per_batch = steps_per_batch
        self.probe: Optional[Callable[[str], None]] = None  # called at named points in manual steps

    def training_step(self, ids: torch.Tensor, batch_idx: int) -> Optional[torch.Tensor]:
        if self.automatic_optimization:
            return lm_loss(self.model, ids)
        optimizer = self.optimizers()
        for _ in range(self.steps_per_batch):
            for _ in range(self.passes):
                self.manual_backward(lm_loss(self.model, ids) / self.passes)
            optimizer.step()
            optimizer.zero_grad()
            if self.probe is not None:
                self.probe("after_step")
        return None

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.optimizer_factory(self.model.parameters())

    def train_dataloader(self) -> DataLoader:
        return DataLoader(token_batches(self.batches_per_epoch), batch_size=None)


def fit(
    module: LightningModule,
    tmp_path: Any,
    steps: int = 3,
    callbacks: Optional[list] = None,
    ckpt_path: Optional[str] = None,
    **kwargs: Any,
) -> Trainer:
    options = dict(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=str(tmp_path),
    )
    options.update(kwargs)
    trainer = Trainer(callbacks=callbacks or [], **options)
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer


def assert_same_parameters(a: nn.Module, b: nn.Module) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    different = [n for n in pa if not torch.equal(pa[n], pb[n])]
    assert not different, f"parameters differ: {different[:5]}"


def saved_activation_bytes(model: nn.Module, run: Callable[[], Any], exclude: Optional[nn.Module] = None) -> tuple[int, int]:
    """Unique bytes autograd saves for backward in ``run()``, counted independently of the
    offloader: each (storage, version) once, parameters, their views, leaves that require grad
    and buffers excluded, and (optionally) nothing saved inside ``exclude``'s forward."""
    resident = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    seen: set[tuple[int, int]] = set()
    total = 0
    inside = [0]

    def is_resident(t: torch.Tensor) -> bool:
        for x in (t, t._base):
            if x is not None and (isinstance(x, nn.Parameter) or (x.is_leaf and x.requires_grad)):
                return True
        return t.untyped_storage().data_ptr() in resident

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        if inside[0] or is_resident(t):
            return t
        storage = t.untyped_storage()
        key = (storage.data_ptr(), t._version)
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
        return t

    handles = []
    if exclude is not None:
        handles.append(exclude.register_forward_pre_hook(lambda *_: inside.__setitem__(0, inside[0] + 1)))
        handles.append(exclude.register_forward_hook(lambda *_: inside.__setitem__(0, inside[0] - 1)))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run()
    finally:
        for h in handles:
            h.remove()
    return total, len(seen)
