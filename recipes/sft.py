"""Supervised fine-tuning of a causal LM on chat / prompt-completion data.

    python -m recipes.sft fit --config configs/sft/tiny_cpu.yaml
    python -m recipes.sft fit --config configs/sft/tiny_cpu.yaml --ckpt_path last   # resume
    python -m recipes.sft fit --config configs/sft/tiny_cpu_lora.yaml               # LoRA adapters
    python -m recipes.sft fit --config configs/sft/tiny_cpu_distill.yaml            # from a teacher's logits
    python -m recipes.sft merge --adapter runs/sft/tiny_cpu_lora/export --out runs/sft/tiny_cpu_lora/merged
    python -m recipes.sft export --config configs/sft/tiny_cpu.yaml \
        --ckpt_path runs/sft/tiny_cpu/checkpoints/last.ckpt --out runs/sft/tiny_cpu/export_last

The memory plan (strategy, precision, checkpointing, offload, optimizer) lives in the YAML; this
file is the algorithm: next-token cross-entropy on the assistant's tokens, as a token mean over
each optimizer step (every micro-batch of the accumulation, every rank). With ``model.lora`` the
base is frozen and LoRA adapters train (:mod:`lightning_mem.lora`): checkpoints then hold the
adapters only, and the export is a peft adapter that ``merge`` folds into a plain HF model. With
``model.distillation`` a frozen teacher's forward (its own phase, ``teacher``) gives its final hidden
states at the same positions, and the divergence of the student's distribution from the teacher's is
mixed with the cross-entropy (:mod:`lightning_mem.distillation`).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import rank_zero_info

from lightning_mem.callbacks import memory_phase
from lightning_mem.callbacks.shared_casts import SharedCasts
from lightning_mem.callbacks.training_dtypes import TrainingDtypes
from lightning_mem.checkpointing import check_trainable_kept, keep_trainable
from lightning_mem.cli import RecipeCLI, run_command
from lightning_mem.data import SFTDataModule
from lightning_mem.data.packing import VARLEN_ATTENTION, check_packing_attention, flatten_rows
from lightning_mem.distillation import DistillationSettings, LogitDistillation
from lightning_mem.export import export_hf, export_main
from lightning_mem.clipping import ClipsGradients
from lightning_mem.gradients import FreesGradientsAfterStep
from lightning_mem.logits import ChunkSize, check_chunk_size, check_supported, next_token_targets, score_tokens
from lightning_mem.lora import (
    LoraSettings,
    apply_lora,
    base_record,
    check_lora_targets,
    export_adapter,
    merge_main,
    meta_model,
    saved_base,
)
from lightning_mem.models import check_model_source, load_causal_lm, load_tokenizer
from lightning_mem.dtypes import cast_trainable, dtype_name, resolve_dtype, trainer_dtypes
from lightning_mem.optim import param_groups, page_where_supported
from lightning_mem.ranks import check_model_splits, check_packing_splits, data_parallel
from lightning_mem.schedules import build_lr_scheduler, check_schedule
from lightning_mem.settings import settings_at


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)


class SFTModule(FreesGradientsAfterStep, ClipsGradients, LightningModule):
    """A causal LM trained on the assistant tokens of each sample.

    Gradients are freed right after each optimizer step (:mod:`lightning_mem.gradients`), not
    during the next step's forward. ``trainer.gradient_clip_val`` clips with any optimizer, torch's
    fused AdamW included, under ``bf16-mixed`` and ``bf16-true`` (:mod:`lightning_mem.clipping`);
    the norm before clipping is logged as ``grad_norm``.

    No step reads a device value back to the host: the collate (:mod:`lightning_mem.data.sft`) sends
    the scored positions, their targets and the label counts with the batch.

    Args:
        name_or_path: local model folder or hub id. A folder with only config.json (like
            ``assets/tiny-llama``) starts from random weights.
        dtype: parameter dtype to load in; None leaves it to ``trainer.precision``, whatever the
            checkpoint's ``torch_dtype``: float32 trained parameters (and so gradients and AdamW
            state) under ``32-true`` and ``*-mixed``, bfloat16 under ``bf16-true``, float16 under
            ``16-true`` (:mod:`lightning_mem.dtypes`). For a full fine-tune a dtype the precision
            contradicts is an error (pure bf16 training is ``trainer.precision: bf16-true``). With
            ``lora`` it is the frozen base's dtype, any dtype ("auto": the checkpoint's) except
            under ``*-true``; None loads the base in the compute dtype (bfloat16 under
            ``bf16-mixed``) while the adapters train in the precision's dtype.
        attn_implementation: "sdpa", "eager" or "flash_attention_2".
        optimizer: any optimizer class from YAML (``torch.optim.AdamW``,
            ``bitsandbytes.optim.PagedAdamW8bit``...); it sees trainable parameters only, with no
            weight decay on norms and biases.
        lr_scheduler: optional, stepped every optimizer step. Leave ``total_steps`` out of
            ``lightning_mem.schedules.WarmupCosineLR``'s init_args and it spans the run
            (``trainer.max_steps``, or the optimizer steps of ``max_epochs``).
        logits_chunk_size: label tokens per chunk through the output layer
            (:mod:`lightning_mem.logits`): at most one chunk's ``[tokens, vocab]`` logits are
            alive in forward or backward, and only label positions are projected. ``auto``: as
            few chunks as keep each within 2**26 logits (:func:`lightning_mem.logits.rows_per_chunk`).
            None or 0: all of a micro-batch's label tokens at once (the unchunked path).
        export_dir: where the trained model and tokenizer are written in Hugging Face format at
            the end of fit, relative to ``trainer.default_root_dir``; None skips the export. With
            ``lora``, the peft adapter and tokenizer are written there instead.
        lora: train LoRA adapters on the frozen base instead of every weight
            (:class:`~lightning_mem.lora.LoraSettings`: ``r``, ``lora_alpha``, ``lora_dropout``,
            ``target_modules``, ``modules_to_save``, ``bias``, peft's names). Target names are
            checked on a meta-device twin before anything loads.
        random_init_dir, init_seed: with ``lora`` and a config-only base folder, the seeded random
            weights the adapters train on are saved there (relative to
            ``trainer.default_root_dir``), so the adapter names a base that can be reloaded.
        distillation: learn from a frozen teacher's distribution too
            (:class:`~lightning_mem.distillation.DistillationSettings`: ``teacher``, ``loss``,
            ``beta``, ``temperature``, ``kd_ratio``, ``top_k``): the training loss becomes
            ``(1 - kd_ratio) * CE + kd_ratio * divergence``, each a token mean over the step; the
            teacher's forward is a phase of its own (``teacher``). Validation stays the CE.
    """

    def __init__(
        self,
        name_or_path: str = "assets/tiny-llama",
        dtype: str | None = None,
        attn_implementation: str | None = None,
        trust_remote_code: bool = False,
        optimizer: OptimizerCallable = _adamw,
        lr_scheduler: LRSchedulerCallable | None = None,
        logits_chunk_size: ChunkSize = 512,
        export_dir: str | None = "export",
        lora: LoraSettings | None = None,
        random_init_dir: str = "random_base",
        init_seed: int = 0,
        distillation: DistillationSettings | None = None,
    ) -> None:
        super().__init__()
        check_model_source(name_or_path, key="model.name_or_path")  # fail before anything is loaded
        resolve_dtype(dtype, key="model.dtype")
        self.logits_chunk_size = check_chunk_size(logits_chunk_size, key="model.logits_chunk_size")
        if isinstance(lora, dict):  # load_from_checkpoint passes the saved hyperparameters back as dicts
            lora = LoraSettings(**lora)
        if lora is not None:
            # On a meta-device twin: a target typo fails here, in a second, not after the load.
            with settings_at("model.lora"):
                check_lora_targets(meta_model(name_or_path, trust_remote_code=trust_remote_code), lora)
            # Checkpoints carry the trainable tensors only, so loading one leaves the base's keys missing.
            self.strict_loading = False
        self.lora = lora
        if isinstance(distillation, dict):  # as lora: the CLI's hparams hold plain dicts
            with settings_at("model.distillation"):
                distillation = DistillationSettings(**distillation)
        self.distillation = LogitDistillation(distillation) if distillation is not None else None
        # logger=False: the CLI logs the whole resolved config (lightning_mem.cli.RunConfigCallback).
        self.save_hyperparameters(ignore=["optimizer", "lr_scheduler"], logger=False)
        self.optimizer_factory = optimizer
        self.lr_scheduler_factory = lr_scheduler
        self.model: torch.nn.Module | None = None

    def setup(self, stage: str) -> None:
        # The data are loaded, the model is not: a schedule that cannot fit the run, or a dtype
        # the precision contradicts, fails now.
        check_schedule(self.lr_scheduler_factory, self.trainer, key="model.lr_scheduler")
        self.model_dtype()
        if getattr(self.trainer.datamodule, "packing", False):
            check_packing_attention(self.hparams.attn_implementation, key="model.attn_implementation", packing_key="data.packing")
            check_packing_splits(self.trainer, packing_key="data.packing")
        # A model the strategy cannot split its way (heads vs tensor/context-parallel sizes) fails now.
        with settings_at("trainer.strategy.init_args"):
            check_model_splits(self.trainer, self.hparams.name_or_path, trust_remote_code=self.hparams.trust_remote_code)
        if self.distillation is not None:  # the teacher's tokenizer, attention and the strategy, before any load
            with settings_at("model.distillation"):
                self.distillation.check(self.hparams.name_or_path, trainer=self.trainer,
                                        trust_remote_code=self.hparams.trust_remote_code,
                                        packing=getattr(self.trainer.datamodule, "packing", False))

    def configure_callbacks(self) -> list[Any]:
        # TrainingDtypes: one line at the start, the dtypes this run really has. SharedCasts: linear
        # layers reading one fp32 tensor share its autocast copy (no number changes; less kept).
        return [TrainingDtypes(), SharedCasts()]

    def model_dtype(self) -> torch.dtype | str:
        """The dtype ``model`` loads in under ``trainer.precision``: what trains follows the precision;
        with ``lora`` the frozen base takes ``dtype``, or the compute dtype when it is unset."""
        dtypes = trainer_dtypes(self._trainer, key="trainer.precision")
        with settings_at("model"):
            return dtypes.load_dtype(self.hparams.dtype, role="trained" if self.lora is None else "frozen",
                                     precision_key="trainer.precision")

    # -- model -------------------------------------------------------------------------------
    def policy_source(self) -> str:
        """Where the model's starting weights load from: ``name_or_path``; with ``lora`` on a
        config-only folder, its seeded random weights saved under ``random_init_dir`` (an adapter
        needs a base on disk it can name)."""
        hp = self.hparams
        if self.lora is None:
            return hp.name_or_path
        return saved_base(self.trainer, hp.name_or_path, hp.random_init_dir, seed=hp.init_seed)

    def configure_model(self) -> None:
        # Loaded here rather than in __init__ so the data are validated first and a strategy can
        # wrap the model (Lightning calls this once, after setup, before the optimizer is made).
        if self.model is not None:
            return
        hp = self.hparams
        self.model = load_causal_lm(
            self.policy_source(),
            dtype=self.model_dtype(),
            attn_implementation=hp.attn_implementation,
            trust_remote_code=hp.trust_remote_code,
            key="model.name_or_path",
        )
        self.model.config.use_cache = False  # training never reuses the KV cache
        if self.lora is not None:
            with settings_at("model"):
                self.model = apply_lora(self.model, self.lora)
            # Adapters (and any modules_to_save copy) train in the precision's dtype on any base.
            cast_trainable(self.model, trainer_dtypes(self._trainer).trained)
        # from_pretrained returns eval mode and Lightning keeps modules as they are: without this
        # dropout (the model's, LoRA's) would never be active, and Lightning would warn at the start
        # of training about modules in eval mode.
        self.model.train()
        if self.logits_chunk_size:  # a model the chunked path cannot score fails here, naming our key
            check_supported(self.model, key="model.logits_chunk_size")
        if self.distillation is not None:  # frozen, outside this module's tree, placed as the YAML says
            with settings_at("model.distillation"):
                self.distillation.load_teacher(self.trainer, compute_dtype=trainer_dtypes(self._trainer).compute,
                                               trust_remote_code=hp.trust_remote_code,
                                               attn_implementation=hp.attn_implementation, init_seed=hp.init_seed)

    def forward(self, **batch: torch.Tensor) -> Any:
        return self.model(**batch)

    # -- the algorithm: cross-entropy on assistant tokens (and the teacher's divergence) -------------
    def loss(self, batch: dict[str, torch.Tensor], *, distill: bool = False) -> tuple[torch.Tensor, int]:
        """``(summed loss, label tokens)`` of a micro-batch; -100 marks prompt and padding. The loss is
        the cross-entropy, mixed with the divergence from the teacher when ``distill`` (training with
        ``model.distillation``)."""
        positions, targets = batch.get("target_positions"), batch.get("target_ids")
        if self.hparams.attn_implementation in VARLEN_ATTENTION:
            flat = flatten_rows(batch)  # varlen flash-attention isolates the examples of one row only
            if flat is not batch:  # the collate's positions are those of the rows
                batch, positions = flat, None
        if positions is None:  # a batch of a datamodule of your own: found on the device (a host sync)
            positions, targets = next_token_targets(batch["input_ids"], batch["labels"])
        teacher = None
        if distill and self.distillation is not None:
            with memory_phase(self._trainer, "teacher"):  # the teacher's forward, no gradients: a phase of its own
                teacher = self.distillation.teacher_hidden(batch["input_ids"], batch.get("attention_mask"), positions,
                                                           position_ids=batch.get("position_ids"))
        # Packed rows (data.packing) have restarting position_ids and no attention mask. With a teacher,
        # the divergence is computed in the same forward, from the same rows and output layer.
        divergence = None if teacher is None else self.distillation.in_forward(teacher, chunk_size=self.logits_chunk_size)
        scores = score_tokens(
            self.model, batch["input_ids"], batch.get("attention_mask"), positions, targets,
            chunk_size=self.logits_chunk_size, position_ids=batch.get("position_ids"), extra=divergence,
        )
        # The count is the targets' length: the host knows it, whoever found them.
        cross_entropy, tokens = -scores.logprobs.sum(), targets.numel()
        if teacher is None:
            return cross_entropy, tokens
        divergence = scores.extra.sum()
        for name, value in (("train_ce_loss", cross_entropy), ("train_kd_loss", divergence)):
            self.log(name, value.detach() / max(tokens, 1), on_step=True, on_epoch=False)
        return self.distillation.mix(cross_entropy, divergence), tokens

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss_sum, tokens = self.loss(batch, distill=True)
        # Tensors on the device, logged without prog_bar: Lightning reads a prog_bar value back after
        # every batch (a host sync per micro-batch on a GPU); the logger reads these at its log steps,
        # and the recipes' progress bars show train_loss from those reads (callbacks/progress.py).
        self.log("train_loss", loss_sum.detach() / max(tokens, 1), on_step=True, on_epoch=False)
        counted = batch.get("label_tokens")
        counted = torch.tensor(tokens, device=loss_sum.device) if counted is None else counted
        self.log("train_label_tokens", counted.float(), on_step=True, on_epoch=False, reduce_fx="sum")
        return loss_sum * self._step_scale(batch, tokens)

    def _step_scale(self, batch: dict[str, torch.Tensor], tokens: int) -> torch.Tensor | float:
        """What turns this micro-batch's summed loss into its share of the step's token mean.

        Lightning divides each micro-batch's loss by ``accumulate_grad_batches`` and the data-
        parallel all-reduce averages over the replicas; multiplying by both and dividing by the label
        tokens of the whole step (all micro-batches, all replicas; the sampler counts them ahead)
        makes the accumulated gradient the gradient of that token mean, whatever the split.
        Without a step count (a datamodule of your own) it falls back to the micro-batch's mean.
        The division runs on the device: the step's count is never read back to the host.
        """
        step_tokens = batch.get("step_label_tokens")
        if step_tokens is None:
            return 1.0 / max(tokens, 1)
        # Replicas, not the world size: the ranks of a tensor- or context-parallel group share a batch
        # (lightning_mem.ranks), and their gradients come out whole (context_parallel's gathers).
        replicas, _ = data_parallel(self.trainer)
        return (self.trainer.accumulate_grad_batches * replicas) / step_tokens.clamp(min=1)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss_sum, tokens = self.loss(batch)
        # Weighted by label tokens: the epoch's val_loss is the token mean over the whole set.
        n = max(tokens, 1)
        self.log("val_loss", loss_sum / n, prog_bar=True, sync_dist=True, batch_size=n)

    def configure_optimizers(self) -> Any:
        # weight_decay=None: the decayed group keeps the optimizer's own (YAML) setting.
        optimizer = self.optimizer_factory(param_groups(self.model, weight_decay=None))
        page_where_supported(optimizer, "model.optimizer")  # before any state: a platform that cannot page runs it unpaged
        if self.lr_scheduler_factory is None:
            return optimizer
        # total_steps left out of the YAML: the schedule spans the trainer's run.
        scheduler = build_lr_scheduler(self.lr_scheduler_factory, optimizer, self.trainer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # -- checkpoints: with adapters, the trainable tensors only ---------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.lora is not None:
            keep_trainable(self, checkpoint)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.lora is not None:
            check_trainable_kept(self, checkpoint)

    # -- export ---------------------------------------------------------------------------------
    def adapter_base_record(self) -> dict[str, Any]:
        """How the base was loaded, written next to an exported adapter (a 4-bit base says so)."""
        hp = self.hparams
        dtype = self.model_dtype()  # what training loaded, so a reload computes what training did
        return base_record(
            None, dtype=dtype if isinstance(dtype, str) else dtype_name(dtype),
            attn_implementation=hp.attn_implementation, trust_remote_code=hp.trust_remote_code,
        )

    def on_fit_end(self) -> None:
        if self.hparams.export_dir is None:
            return
        self.export(Path(self.trainer.default_root_dir) / self.hparams.export_dir)

    def export(self, out: Path) -> None:
        """Write the model (with ``lora``: the peft adapter) and tokenizer to ``out`` (also
        ``python -m recipes.sft export``)."""
        hp = self.hparams
        tokenizer = load_tokenizer(hp.name_or_path, trust_remote_code=hp.trust_remote_code, key="model.name_or_path")
        if self.lora is not None:
            export_adapter(self.trainer, self.model, tokenizer, out, base=self.adapter_base_record())
            rank_zero_info(f"exported the adapter and tokenizer to {out}")
            return
        export_hf(self.trainer, self.model, tokenizer, out)
        rank_zero_info(f"exported the model and tokenizer to {out}")


def main(args: list[str] | None = None) -> RecipeCLI | Path:
    argv = sys.argv[1:] if args is None else list(args)
    # `merge` is not a Trainer subcommand, so it is dispatched before LightningCLI sees argv.
    if argv[:1] == ["merge"]:
        return merge_main(argv[1:], prog="python -m recipes.sft merge")
    # `export` (from a checkpoint) is not a Trainer subcommand: dispatched before LightningCLI.
    if argv[:1] == ["export"]:
        return export_main(RecipeCLI, SFTModule, SFTDataModule, argv[1:])
    return RecipeCLI(SFTModule, SFTDataModule, args=args, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    run_command(main)
