"""Models, data and single-process references shared by the FSDP2 tests and their worker.

The LightningModules here hold HF models as plain attributes and write no
``configure_model`` sharding code: the strategy finds and shards them. Every random
thing is seeded, so every rank (and the single-process reference in the pytest process)
starts from the same weights and sees the same tokens.
"""

from __future__ import annotations

from collections.abc import Iterator

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader

SEQ_LEN = 32
GLOBAL_BATCH = 4
STEPS_PER_EPOCH = 3
LR = 1e-3


def tiny_config(**overrides):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=256,
        **overrides,
    )


def tiny_llama(seed: int, **overrides) -> nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_config(**overrides))


def tokens(num_samples: int = GLOBAL_BATCH * STEPS_PER_EPOCH, seed: int = 1234) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 512, (num_samples, SEQ_LEN), generator=generator)


def train_loader(per_rank_batch: int) -> DataLoader:
    # Lightning swaps in a DistributedSampler that shuffles training data with seed 0 and
    # the epoch number; `global_batches` replays exactly that order.
    return DataLoader(list(tokens()), batch_size=per_rank_batch, shuffle=False)


def global_batches(epochs: int, world_size: int = 2) -> Iterator[Tensor]:
    """The union over ranks of what each rank's DistributedSampler yields, step by step."""
    data = tokens()
    per_rank = GLOBAL_BATCH // world_size
    for epoch in range(epochs):
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(epoch))
        shards = [order[rank::world_size] for rank in range(world_size)]
        for step in range(len(data) // GLOBAL_BATCH):
            window = slice(step * per_rank, (step + 1) * per_rank)
            yield data[torch.cat([shard[window] for shard in shards])]


class _RecordsLosses(pl.LightningModule):
    """Keeps the loss averaged over all ranks (= the loss of the global batch) per step."""

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[float] = []

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        loss = self.compute_loss(batch)
        # Every rank has the same number of tokens, so the mean of rank means is the
        # global-batch mean that a single process would compute.
        self.losses.append(self.trainer.strategy.reduce(loss.detach(), reduce_op="mean").item())
        return loss

    def compute_loss(self, batch: Tensor) -> Tensor:
        raise NotImplementedError


class PolicyRefValue(_RecordsLosses):
    """PPO-shaped: a trainable policy, a frozen reference and a value head (no HF model).

    The optimizer gets ``self.parameters()``, frozen ones included, as a naive user would:
    the frozen reference must still end up with no optimizer state. The policy ties its
    input and output embeddings (as Qwen2.5-0.5B does), which sharding and export must keep.
    """

    def __init__(self) -> None:
        super().__init__()
        self.policy = tiny_llama(seed=0, tie_word_embeddings=True)
        self.ref = tiny_llama(seed=1).requires_grad_(False)
        torch.manual_seed(2)
        # Two outputs keep dim 0 even, so a 2-rank shard is exactly half (as in the HF models).
        self.value_head = nn.Linear(256, 2)

    def compute_loss(self, batch: Tensor) -> Tensor:
        out = self.policy(input_ids=batch, labels=batch, output_hidden_states=True)
        with torch.no_grad():
            ref_logits = self.ref(input_ids=batch).logits
        targets = batch[:, 1:, None]
        logp = F.log_softmax(out.logits[:, :-1].float(), -1).gather(-1, targets)
        ref_logp = F.log_softmax(ref_logits[:, :-1].float(), -1).gather(-1, targets)
        value = self.value_head(out.hidden_states[-1]).float()
        return out.loss + 0.1 * (logp - ref_logp).mean() + 0.01 * value.pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LR)


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])


def lora_policy() -> nn.Module:
    from peft import get_peft_model

    base = tiny_llama(seed=0)
    torch.manual_seed(3)
    return get_peft_model(base, lora_config())


class LoraWithMetaReward(_RecordsLosses):
    """Builds its models in ``configure_model``: a LoRA policy from real weights and a frozen
    reward model plus score head on the meta device (the strategy must materialize and
    initialize both). It shards the head itself, as existing ``configure_model`` code may:
    the strategy must leave that unit alone and still materialize it.
    """

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        if hasattr(self, "policy"):
            return
        self.policy = lora_policy()
        with torch.device("meta"):
            self.reward = tiny_llama(seed=4, pad_token_id=0).requires_grad_(False)
            self.reward_head = nn.Linear(256, 2).requires_grad_(False)
        # reshard_after_forward=True: FSDP2's default keeps a root unit gathered after
        # forward, and a frozen head never runs the backward that would reshard it.
        fully_shard(self.reward_head, mesh=self.device_mesh["data_parallel"], reshard_after_forward=True)
        self.forward_weight_dtypes: set[str] = set()
        q_proj = self.policy.base_model.model.model.layers[0].self_attn.q_proj.base_layer
        q_proj.register_forward_pre_hook(lambda module, args: self.forward_weight_dtypes.add(str(module.weight.dtype)))

    def compute_loss(self, batch: Tensor) -> Tensor:
        loss = self.policy(input_ids=batch, labels=batch).loss
        with torch.no_grad():
            hidden = self.reward(input_ids=batch, output_hidden_states=True).hidden_states[-1]
            # The user sharded this head without a mixed-precision policy: it computes in fp32.
            self.reward_scores.append(self.reward_head(hidden.float()).mean().item())
        return loss

    def on_fit_start(self) -> None:
        self.reward_scores: list[float] = []

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=LR)


class Bf16Checkpoint(_RecordsLosses):
    """Two models read from a folder whose config says ``torch_dtype: bfloat16`` (as every real
    checkpoint's does), each loaded in the dtype :mod:`lightning_mem.dtypes` gives its role under
    the trainer's precision, as the recipes load theirs:

    - ``policy``: fully trained, so float32 under ``32-true`` whatever the checkpoint says;
    - ``lora_policy``: a frozen base loaded in bfloat16 (an explicit ``dtype``, which a frozen
      role keeps) with LoRA adapters in float32: both dtypes inside every decoder block's unit.

    Forward pre-hooks record the weight dtypes each model's first q_proj computes with.
    """

    def __init__(self, folder: str) -> None:
        super().__init__()
        self.folder = folder

    def configure_model(self) -> None:
        from lightning_mem.dtypes import cast_trainable, trainer_dtypes
        from lightning_mem.lora import LoraSettings, apply_lora
        from lightning_mem.models import load_causal_lm

        if hasattr(self, "policy"):
            return
        dtypes = trainer_dtypes(self.trainer)
        torch.manual_seed(0)  # the same weights on every rank
        self.policy = load_causal_lm(self.folder, dtype=dtypes.load_dtype(None, role="trained"))
        torch.manual_seed(1)
        base = load_causal_lm(self.folder, dtype=dtypes.load_dtype("bfloat16", role="frozen"))
        torch.manual_seed(2)
        self.lora_policy = apply_lora(base, LoraSettings(r=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]))
        cast_trainable(self.lora_policy, dtypes.trained)
        self.forward_weight_dtypes: dict[str, set[str]] = {"policy": set(), "lora_base": set(), "lora_adapter": set()}
        q_proj = self.policy.model.layers[0].self_attn.q_proj
        lora_q = self.lora_policy.base_model.model.model.layers[0].self_attn.q_proj
        for name, layer in (("policy", q_proj), ("lora_base", lora_q.base_layer), ("lora_adapter", lora_q.lora_A["default"])):
            layer.register_forward_pre_hook(lambda m, args, name=name: self.forward_weight_dtypes[name].add(str(m.weight.dtype)))

    def compute_loss(self, batch: Tensor) -> Tensor:
        return self.policy(input_ids=batch, labels=batch).loss + self.lora_policy(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=LR)


class PolicyOnly(_RecordsLosses):
    """SFT-shaped: one trainable HF model (the GPU memory test)."""

    def __init__(self) -> None:
        super().__init__()
        self.policy = tiny_llama(seed=0)

    def compute_loss(self, batch: Tensor) -> Tensor:
        return self.policy(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LR)


def reference_losses(loss_fn, params, epochs: int) -> list[float]:
    """Plain single-process training on the global batches: what sharding must reproduce."""
    optimizer = torch.optim.AdamW([p for p in params if p.requires_grad], lr=LR)
    losses = []
    for batch in global_batches(epochs):
        loss = loss_fn(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses
