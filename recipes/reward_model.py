"""Reward-model training: Bradley-Terry on preference pairs, a sequence classifier with one output.

    python -m recipes.reward_model fit --config configs/reward_model/tiny_cpu.yaml
    python -m recipes.reward_model fit --config configs/reward_model/tiny_cpu.yaml --ckpt_path last   # resume
    python -m recipes.reward_model export --config configs/reward_model/tiny_cpu.yaml \
        --ckpt_path runs/reward_model/tiny_cpu/checkpoints/last.ckpt --out runs/reward_model/tiny_cpu/export_last
    python -m recipes.ppo fit --config configs/ppo/tiny_cpu_reward_model.yaml   # PPO on the export

The memory plan (strategy, precision, checkpointing, offload, optimizer) lives in the YAML; this
file is the algorithm. Each micro-batch holds ``B`` preference pairs as ``2B`` sequences, chosen
sides first (:class:`lightning_mem.data.PreferenceDataModule`):

1. rewards: the backbone runs once over all ``2B`` sequences (padded or packed), and the score head
   reads each sequence's last token only (:class:`lightning_mem.reward_modeling.SequenceScorer`);
2. loss: ``-log sigmoid(r_chosen - r_rejected - margin)`` per pair, plus
   ``center_rewards_coefficient * (r_chosen + r_rejected)^2``, as a mean over the optimizer step's
   pairs (every micro-batch of the accumulation, every rank);
3. metrics: TRL's RewardTrainer's (accuracy, margin, mean/min/max reward), on training and
   validation pairs.

The export (end of fit, and ``export``) is a plain Hugging Face classifier that ``recipes.ppo``'s
``model.reward_model`` loads as it is; with ``model.lora`` the adapters are merged into it and the
trained head included.
"""

from __future__ import annotations

import re
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from jsonargparse.typing import NonNegativeFloat
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import rank_zero_info

from lightning_mem.callbacks.shared_casts import SharedCasts
from lightning_mem.callbacks.training_dtypes import TrainingDtypes
from lightning_mem.checkpointing import check_trainable_kept, keep_trainable
from lightning_mem.cli import RecipeCLI, run_command
from lightning_mem.clipping import ClipsGradients
from lightning_mem.data import PreferenceDataModule
from lightning_mem.data.preference import flatten_pair_rows
from lightning_mem.data.packing import VARLEN_ATTENTION, check_packing_attention
from lightning_mem.dtypes import cast_trainable, trainer_dtypes, resolve_dtype
from lightning_mem.export import export_main
from lightning_mem.gradients import FreesGradientsAfterStep
from lightning_mem.lora import LoraSettings, apply_lora, check_lora_targets, meta_model, saved_base
from lightning_mem.models import check_model_source, load_pretrained, load_tokenizer
from lightning_mem.optim import page_where_supported, param_groups
from lightning_mem.ranks import check_model_splits, check_packing_splits, data_parallel
from lightning_mem.reward_modeling import (
    HEAD_NAMES,
    SequenceScorer,
    bradley_terry,
    check_unsplit,
    export_classifier,
    head_name,
    pair_metrics,
    read_positions,
)
from lightning_mem.schedules import build_lr_scheduler, check_schedule
from lightning_mem.settings import SettingError, settings_at


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-5)


def _classifier_class() -> Any:
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification


class RewardModelModule(FreesGradientsAfterStep, ClipsGradients, LightningModule):
    """A sequence classifier with one output, trained on preference pairs.

    Gradients are freed right after each optimizer step, and ``trainer.gradient_clip_val`` clips
    with any optimizer under any precision, as in the SFT recipe. No step reads a device value
    back to the host: the collate sends each sequence's last position and the step's pair count.

    Args:
        name_or_path: the model to start from: usually the SFT export (a causal LM: its backbone
            loads, its LM head is left out, and the score head is new, initialised as
            ``transformers`` initialises it: normal with std ``initializer_range``, under the run's
            seed); a reward model to go on training; or a folder with only config.json (like
            ``assets/tiny-llama``), all at random.
        dtype, attn_implementation, trust_remote_code: as in the SFT recipe; what trains (the
            whole model, or the adapters and the score head) follows ``trainer.precision``.
        optimizer, lr_scheduler: as in the SFT recipe.
        center_rewards_coefficient: weight of the mean of ``(r_chosen + r_rejected)^2`` added to the
            loss (TRL's ``center_rewards_coefficient``; Eisenstein et al. 2023 use 0.01): it keeps
            rewards near 0 without changing which side wins. 0 leaves it out.
        export_dir: where the trained classifier and tokenizer are written at the end of fit,
            relative to ``trainer.default_root_dir``; None skips the export.
        lora: train LoRA adapters on the frozen backbone and the score head in full (peft's
            ``modules_to_save``); the export merges them into a plain classifier.
        random_init_dir, init_seed: with ``lora`` and a config-only folder, the seeded random base
            the adapters train on is saved there, so a resumed run finds the same base.
    """

    def __init__(
        self,
        name_or_path: str = "assets/tiny-llama",
        dtype: str | None = None,
        attn_implementation: str | None = None,
        trust_remote_code: bool = False,
        optimizer: OptimizerCallable = _adamw,
        lr_scheduler: LRSchedulerCallable | None = None,
        center_rewards_coefficient: NonNegativeFloat = 0.0,
        export_dir: str | None = "export",
        lora: LoraSettings | None = None,
        random_init_dir: str = "random_base",
        init_seed: int = 0,
    ) -> None:
        super().__init__()
        check_model_source(name_or_path, key="model.name_or_path")  # fail before anything is loaded
        resolve_dtype(dtype, key="model.dtype")
        if center_rewards_coefficient < 0:
            raise SettingError("model.center_rewards_coefficient", f" must be 0 or more, got {center_rewards_coefficient}")
        if isinstance(lora, dict):  # load_from_checkpoint may pass the saved hyperparameters back as dicts
            lora = LoraSettings(**lora)
        if lora is not None:
            # On a meta-device twin of the classifier: a target typo fails here, not after the load;
            # "all-linear" leaves the score head out (it trains whole, see configure_model).
            with settings_at("model.lora"):
                check_lora_targets(self._meta_classifier(name_or_path, trust_remote_code), lora)
            self.strict_loading = False  # checkpoints carry the adapters and the head only
        self.lora = lora
        # logger=False: the CLI logs the whole resolved config (lightning_mem.cli.RunConfigCallback).
        self.save_hyperparameters(ignore=["optimizer", "lr_scheduler"], logger=False)
        self.optimizer_factory = optimizer
        self.lr_scheduler_factory = lr_scheduler
        self.scorer: SequenceScorer | None = None
        self.tokenizer: Any = None

    @staticmethod
    def _meta_classifier(name_or_path: str, trust_remote_code: bool) -> torch.nn.Module:
        return meta_model(name_or_path, trust_remote_code=trust_remote_code, auto_class=_classifier_class(),
                          config_kwargs={"num_labels": 1})

    def setup(self, stage: str) -> None:
        # The data are loaded, the model is not: what cannot work fails now.
        check_schedule(self.lr_scheduler_factory, self.trainer, key="model.lr_scheduler")
        self.model_dtype()
        if getattr(self.trainer.datamodule, "packing", False):
            check_packing_attention(self.hparams.attn_implementation, key="model.attn_implementation", packing_key="data.packing")
            check_packing_splits(self.trainer, packing_key="data.packing")
        with settings_at("trainer.strategy.init_args"):
            check_unsplit(self.trainer.strategy)  # a reward is read at one position of the whole sequence
            check_model_splits(self.trainer, self.hparams.name_or_path, trust_remote_code=self.hparams.trust_remote_code)

    def configure_callbacks(self) -> list[Any]:
        return [TrainingDtypes(), SharedCasts()]

    def model_dtype(self) -> torch.dtype | str:
        """The dtype the classifier loads in under ``trainer.precision`` (as in the SFT recipe)."""
        dtypes = trainer_dtypes(self._trainer, key="trainer.precision")
        with settings_at("model"):
            return dtypes.load_dtype(self.hparams.dtype, role="trained" if self.lora is None else "frozen",
                                     precision_key="trainer.precision")

    # -- model -------------------------------------------------------------------------------
    def configure_model(self) -> None:
        if self.scorer is not None:
            return
        hp = self.hparams
        source = hp.name_or_path
        if self.lora is not None:  # a config-only base: seeded random weights on disk, found again on resume
            source = saved_base(self._trainer, source, hp.random_init_dir, seed=hp.init_seed)
        self.tokenizer = load_tokenizer(hp.name_or_path, trust_remote_code=hp.trust_remote_code, key="model.name_or_path")
        # From a causal LM (the SFT export) the backbone loads and the score head starts at random, by
        # design: said in one line, not as a warning (report_missing: a warning for any *other* weight
        # the checkpoint lacks, instead of transformers' report of the LM head it leaves unused).
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = load_pretrained(
                _classifier_class(), source, dtype=self.model_dtype(), attn_implementation=hp.attn_implementation,
                trust_remote_code=hp.trust_remote_code, key="model.name_or_path", config_kwargs={"num_labels": 1},
                report_missing=True,
            )
        new_head = re.compile(rf"no weights for ({'|'.join(HEAD_NAMES)})\.weight; they start at random")
        for warning in caught:
            if new_head.search(str(warning.message)):
                rank_zero_info(f"reward model: the backbone of {hp.name_or_path} and a new score head (normal, std"
                               f" {model.config.initializer_range:g})")
            else:
                warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
        # Where Hugging Face's forward (and so the exported model) stops reading: the data's pad token.
        model.config.pad_token_id = self.tokenizer.pad_token_id
        model.config.use_cache = False
        if self.lora is not None:
            from dataclasses import replace

            head = head_name(model)
            saved = list(dict.fromkeys([*(self.lora.modules_to_save or []), head]))
            with settings_at("model"):
                model = apply_lora(model, replace(self.lora, modules_to_save=saved), task_type="SEQ_CLS")
            cast_trainable(model, trainer_dtypes(self._trainer).trained)  # adapters and the head's copy
        model.train()  # from_pretrained returns eval mode; dropout (the model's, LoRA's) should be on
        self.scorer = SequenceScorer(model)

    # -- the algorithm: Bradley-Terry over the step's pairs ------------------------------------
    def rewards(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """``[2B]`` rewards of the micro-batch's sequences, chosen sides first."""
        if self.hparams.attn_implementation in VARLEN_ATTENTION:
            batch = flatten_pair_rows(batch)  # varlen flash-attention isolates the sequences of one row only
        positions = read_positions(batch["input_ids"], batch["sequence_ends"], self.scorer.config.pad_token_id)
        return self.scorer(batch["input_ids"], batch.get("attention_mask"), positions, position_ids=batch.get("position_ids"))

    def loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(summed loss over the pairs, chosen rewards, rejected rewards)``."""
        rewards = self.rewards(batch)
        pairs = rewards.shape[0] // 2
        chosen, rejected = rewards[:pairs], rewards[pairs:]
        per_pair = bradley_terry(chosen, rejected, batch.get("margin"), self.hparams.center_rewards_coefficient)
        return per_pair.sum(), chosen, rejected

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss_sum, chosen, rejected = self.loss(batch)
        pairs = chosen.shape[0]
        # Device tensors without prog_bar: nothing is read back per micro-batch (see recipes/sft.py).
        self.log("train_loss", loss_sum.detach() / pairs, on_step=True, on_epoch=False)
        for name, value in pair_metrics(chosen, rejected).items():
            self.log(f"train_{name}", value, on_step=True, on_epoch=False)
        return loss_sum * self._step_scale(batch, pairs)

    def _step_scale(self, batch: dict[str, torch.Tensor], pairs: int) -> torch.Tensor | float:
        """What turns this micro-batch's summed loss into its share of the step's mean over pairs:
        Lightning divides by ``accumulate_grad_batches`` and the data-parallel all-reduce averages
        over the replicas, so multiply by both and divide by the pairs of the whole step (the sampler
        counts them ahead). Without a step count (a datamodule of your own): the micro-batch's mean."""
        step_pairs = batch.get("step_pairs")
        if step_pairs is None:
            return 1.0 / max(pairs, 1)
        replicas, _ = data_parallel(self.trainer)
        return (self.trainer.accumulate_grad_batches * replicas) / step_pairs.clamp(min=1)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss_sum, chosen, rejected = self.loss(batch)
        pairs = chosen.shape[0]
        # Weighted by pairs: each epoch value is the mean over every validation pair.
        self.log("val_loss", loss_sum / pairs, prog_bar=True, sync_dist=True, batch_size=pairs)
        for name, value in pair_metrics(chosen, rejected).items():
            reduce = {"min_reward": "min", "max_reward": "max"}.get(name, "mean")
            self.log(f"val_{name}", value, prog_bar=name == "accuracy", sync_dist=True, batch_size=pairs,
                     reduce_fx=reduce)

    def configure_optimizers(self) -> Any:
        optimizer = self.optimizer_factory(param_groups(self.scorer, weight_decay=None))
        page_where_supported(optimizer, "model.optimizer")
        if self.lr_scheduler_factory is None:
            return optimizer
        scheduler = build_lr_scheduler(self.lr_scheduler_factory, optimizer, self.trainer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # -- checkpoints: with adapters, the trainable tensors only ---------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.lora is not None:
            keep_trainable(self, checkpoint)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.lora is not None:
            check_trainable_kept(self, checkpoint)

    # -- export -----------------------------------------------------------------------------------
    def on_fit_end(self) -> None:
        if self.hparams.export_dir is None:
            return
        self.export(Path(self.trainer.default_root_dir) / self.hparams.export_dir)

    def export(self, out: Path) -> None:
        """Write the classifier (adapters merged) and tokenizer to ``out`` (also ``python -m
        recipes.reward_model export``): the folder ``recipes.ppo``'s ``model.reward_model`` loads."""
        export_classifier(self.trainer, self.scorer.model, self.tokenizer, out)
        rank_zero_info(f"exported the reward model and tokenizer to {out}")


def main(args: list[str] | None = None) -> RecipeCLI | Path:
    argv = sys.argv[1:] if args is None else list(args)
    # `export` (from a checkpoint) is not a Trainer subcommand: dispatched before LightningCLI.
    if argv[:1] == ["export"]:
        return export_main(RecipeCLI, RewardModelModule, PreferenceDataModule, argv[1:])
    return RecipeCLI(RewardModelModule, PreferenceDataModule, args=args, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    run_command(main)
