"""The recipes' real modules, data and steps, run split (tensor / context parallel) and whole.

Shared by ``model_parallel_worker.py`` (the split runs, on gloo ranks) and
``test_model_parallel.py`` (the one-process references, in the pytest process). Each run is a
``Trainer.fit`` of the SFT or PPO recipe's module on the tiny Llama, seeded so every rank and the
reference start from the same weights, data and sampling stream. What a run reports:

- per training batch, the metrics the step logged (SFT's ``train_loss``, PPO's losses and KL);
- at the first optimizer step, every gradient, whole (``gradients.pt``, written by global rank 0);
- per model, the parameter bytes this rank holds and the whole model's;
- for the ``activations`` run, the unique bytes saved for backward in one training step
  (storages counted once, parameters excluded), on a 2,048-token sequence.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_mem.logits import ScoredOutputLayer
from lightning_mem.rl.reward import RewardFunction

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "assets" / "tiny-llama")
ARITH = REPO / "data" / "arithmetic"

#: Padded tokens of an SFT step's batch, per data-parallel replica: with this budget the arithmetic
#: set packs into an even number of batches, so a 2-replica run's first step holds the same two
#: batches as a 1-process run accumulating 2 (an odd count would be split differently).
SFT_BUDGET = 256
LONG_SEQUENCE = 2048


class LengthReward(RewardFunction):
    """The response's length in characters / 10: it varies between the random model's samples (the
    arithmetic rewards are all 0 there), so advantages are not zero and the update moves the actor."""

    def score(self, prompts, responses, rows):
        return [len(r) / 10 for r in responses]


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    # A collective for a DTensor: every rank of the mesh must call it.
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class Recorder(Callback):
    """Each batch's logged metrics; every gradient at the first optimizer step (whole, rank 0 saves)."""

    def __init__(self, gradients_path: Path | None) -> None:
        self.metrics: list[dict[str, float]] = []
        self.gradients_path = gradients_path
        self.taken = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.metrics.append({k: float(v) for k, v in trainer.callback_metrics.items()})

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.taken or self.gradients_path is None:
            return
        self.taken = True
        grads = {name: _whole(p.grad).detach().clone() for name, p in pl_module.named_parameters() if p.grad is not None}
        if trainer.is_global_zero:
            torch.save(grads, self.gradients_path)


class SavedActivations(Callback):
    """Unique bytes saved for backward during one training step's forward (``saved_tensors_hooks``:
    each storage once, parameters' storages excluded; a DTensor counts its local part)."""

    def __init__(self) -> None:
        self.bytes: list[int] = []
        self._hooks: Any = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        seen: dict[int, int] = {}

        def parameters() -> Any:
            # While the forward runs, lightning_mem.logits' ScoredOutputLayer stands in for the output
            # layer and holds it outside the module tree: its weight (which the fused path saves)
            # is a parameter all the same. Looked up at each pack: FSDP2 unshards during the forward.
            for module in pl_module.modules():
                yield from module.parameters(recurse=False)
                if isinstance(module, ScoredOutputLayer):
                    yield from module.output_layer.parameters()

        def pack(t: torch.Tensor) -> torch.Tensor:
            local = _local(t)
            params = {_local(p).untyped_storage().data_ptr() for p in parameters()}
            storage = local.untyped_storage()
            if storage.data_ptr() not in params and storage.nbytes():
                seen[storage.data_ptr()] = storage.nbytes()
            return t

        self._seen = seen
        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._hooks.__enter__()

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None
            self.bytes.append(sum(self._seen.values()))


def parameter_bytes(module: torch.nn.Module) -> dict[str, int]:
    params = list(module.parameters())
    return {
        "local": sum(_local(p).numel() * p.element_size() for p in params),
        "whole": sum(p.numel() * p.element_size() for p in params),
        # Parameters split by tensor parallelism (a DTensor placement other than Replicate on the
        # tensor-parallel mesh dimension), and what this rank holds of them.
        "split_whole": sum(p.numel() * p.element_size() for p in params if _tensor_split(p)),
        "split_local_x_fsdp": sum(_local(p).numel() * p.element_size() for p in params if _tensor_split(p)),
    }


def _tensor_split(p: torch.Tensor) -> bool:
    if not isinstance(p, DTensor) or "tensor_parallel" not in (p.device_mesh.mesh_dim_names or ()):
        return False
    return not p.placements[p.device_mesh.mesh_dim_names.index("tensor_parallel")].is_replicate()


# ---------------------------------------------------------------------------------------------
# The runs
# ---------------------------------------------------------------------------------------------


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def sft_parts(run: dict, cp: int) -> tuple[pl.LightningModule, Any]:
    from lightning_mem.data import SFTDataModule
    from lightning_mem.lora import LoraSettings
    from recipes.sft import SFTModule

    lora = LoraSettings(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear") if run.get("lora") else None
    module = SFTModule(name_or_path=TINY, optimizer=_adamw, logits_chunk_size=64, export_dir=None, lora=lora,
                       random_init_dir=run.get("random_init_dir", "random_base"))
    data = SFTDataModule(train_file=str(ARITH / "train.jsonl"), tokenizer=TINY, max_length=64,
                         max_tokens_per_batch=SFT_BUDGET // cp, seed=0)
    return module, data


class _LongSequence(torch.utils.data.Dataset):
    """One sequence of ``LONG_SEQUENCE`` random tokens, every next token a label."""

    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(1, 300, (LONG_SEQUENCE,), generator=torch.Generator().manual_seed(7))
        return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


def ppo_parts(run: dict) -> tuple[pl.LightningModule, Any]:
    from lightning_mem.data import PromptDataModule
    from lightning_mem.rl.config import GRPOConfig, PPOConfig
    from lightning_mem.rl.rollout import GenerationConfig
    from recipes.ppo import PPOModule

    grpo = run["kind"] == "grpo"
    module = PPOModule(
        name_or_path=TINY, reward=LengthReward(), advantage_estimator="grpo" if grpo else "gae",
        generation=GenerationConfig(max_new_tokens=6, do_sample=run.get("do_sample", True)),
        ppo=PPOConfig(ppo_epochs=1, num_mini_batches=run.get("mini_batches", 2), max_tokens_per_microbatch=128,
                      whiten_advantages=not grpo),
        grpo=GRPOConfig(group_size=4), optimizer=_adamw, critic_optimizer=_adamw, logits_chunk_size=16,
        export_dir=None,
    )
    data = PromptDataModule(str(ARITH / "prompts.jsonl"), tokenizer=TINY, batch_size=run.get("batch_size", 4),
                            max_prompt_length=64, seed=0)
    return module, data


def fit(run: dict, out: Path, *, devices: int = 1, strategy: Any = None) -> dict:
    """One run (``run["kind"]``: ``sft``, ``ppo``, ``grpo`` or ``activations``); its report."""
    pl.seed_everything(0)
    cp = getattr(strategy, "context_parallel_size", 1) if strategy is not None else 1
    gradients = out / f"{run['name']}.gradients.pt"
    recorder = Recorder(gradients)
    callbacks: list[Callback] = [recorder]
    saved = SavedActivations() if run["kind"] == "activations" else None
    if saved is not None:
        callbacks.append(saved)
    trainer_kwargs: dict[str, Any] = dict(
        accelerator="cpu", devices=devices, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=str(out / run["name"]), callbacks=callbacks,
        num_sanity_val_steps=0, limit_val_batches=0,
    )
    if strategy is not None:
        trainer_kwargs["strategy"] = strategy
    train_loader = None
    if run["kind"] in ("sft", "activations"):
        module, data = sft_parts(run, cp)
        trainer_kwargs.update(max_steps=run.get("steps", 2), accumulate_grad_batches=run.get("accumulate", 1),
                              gradient_clip_val=1.0)
        if run["kind"] == "activations":
            data, train_loader = None, DataLoader(_LongSequence(), batch_size=1)
            trainer_kwargs.update(max_steps=1)
    else:
        module, data = ppo_parts(run)
        trainer_kwargs.update(max_epochs=1, limit_train_batches=1)
    trainer = pl.Trainer(**trainer_kwargs)
    if train_loader is not None:
        trainer.fit(module, train_dataloaders=train_loader)
    else:
        trainer.fit(module, datamodule=data)
    models = {name: parameter_bytes(getattr(module, name)) for name in ("model", "actor", "critic", "reference")
              if getattr(module, name, None) is not None}
    return {"metrics": recorder.metrics, "models": models, "saved_bytes": saved.bytes if saved else None,
            "rank": trainer.global_rank, "world_size": trainer.world_size}
