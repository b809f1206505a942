"""Supervised fine-tuning of a causal LM on chat / prompt-completion data.

    python -m recipes.sft fit --config configs/sft/tiny_cpu.yaml
    python -m recipes.sft fit --config configs/sft/tiny_cpu.yaml --ckpt_path last   # resume

The memory plan (strategy, precision, checkpointing, offload, optimizer) lives in the YAML; this
file is the algorithm: next-token cross-entropy on the assistant's tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import rank_zero_info

from lightning_mem.cli import RecipeCLI
from lightning_mem.data import SFTDataModule
from lightning_mem.export import export_hf
from lightning_mem.models import check_model_source, load_causal_lm, load_tokenizer, resolve_dtype
from lightning_mem.optim import param_groups, warn_if_paged_on_cpu


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)


class SFTModule(LightningModule):
    """A causal LM trained on the assistant tokens of each sample.

    Args:
        name_or_path: local model folder or hub id. A folder with only config.json (like
            ``assets/tiny-llama``) starts from random weights.
        dtype: parameter dtype to load in ("bfloat16", "float32", "auto"); None leaves it to the
            trainer's precision.
        attn_implementation: "sdpa", "eager" or "flash_attention_2".
        optimizer: any optimizer class from YAML (``torch.optim.AdamW``,
            ``bitsandbytes.optim.PagedAdamW8bit``...); it sees trainable parameters only, with no
            weight decay on norms and biases.
        lr_scheduler: optional, stepped every optimizer step.
        export_dir: where the trained model and tokenizer are written in Hugging Face format at
            the end of fit, relative to ``trainer.default_root_dir``; None skips the export.
    """

    def __init__(
        self,
        name_or_path: str = "assets/tiny-llama",
        dtype: str | None = None,
        attn_implementation: str | None = None,
        trust_remote_code: bool = False,
        optimizer: OptimizerCallable = _adamw,
        lr_scheduler: LRSchedulerCallable | None = None,
        export_dir: str | None = "export",
    ) -> None:
        super().__init__()
        check_model_source(name_or_path)  # fail before anything is loaded
        resolve_dtype(dtype, key="model.dtype")
        # logger=False: the CLI logs the whole resolved config (lightning_mem.cli.RunConfigCallback).
        self.save_hyperparameters(ignore=["optimizer", "lr_scheduler"], logger=False)
        self.optimizer_factory = optimizer
        self.lr_scheduler_factory = lr_scheduler
        self.model: torch.nn.Module | None = None

    # -- model -------------------------------------------------------------------------------
    def configure_model(self) -> None:
        # Loaded here rather than in __init__ so the data are validated first and a strategy can
        # wrap the model (Lightning calls this once, after setup, before the optimizer is made).
        if self.model is not None:
            return
        hp = self.hparams
        self.model = load_causal_lm(
            hp.name_or_path,
            dtype=hp.dtype,
            attn_implementation=hp.attn_implementation,
            trust_remote_code=hp.trust_remote_code,
        )
        self.model.config.use_cache = False  # training never reuses the KV cache

    def forward(self, **batch: torch.Tensor) -> Any:
        return self.model(**batch)

    # -- the algorithm: cross-entropy on assistant tokens ---------------------------------------
    def _loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        # The model shifts labels by one internally; -100 marks prompt and padding tokens.
        return self.model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]
        ).loss

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True, on_step=True, on_epoch=False)
        self.log("train_tokens", float(batch["attention_mask"].sum()), on_step=True, reduce_fx="sum")
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> Any:
        # weight_decay=None: the decayed group keeps the optimizer's own (YAML) setting.
        optimizer = self.optimizer_factory(param_groups(self.model, weight_decay=None))
        warn_if_paged_on_cpu(optimizer)
        if self.lr_scheduler_factory is None:
            return optimizer
        scheduler = self.lr_scheduler_factory(optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # -- export ---------------------------------------------------------------------------------
    def on_fit_end(self) -> None:
        if self.hparams.export_dir is None:
            return
        out = Path(self.trainer.default_root_dir) / self.hparams.export_dir
        tokenizer = load_tokenizer(self.hparams.name_or_path)
        export_hf(self.trainer, self.model, tokenizer, out)
        rank_zero_info(f"exported the model and tokenizer to {out}")


def main(args: list[str] | None = None) -> RecipeCLI:
    return RecipeCLI(SFTModule, SFTDataModule, args=args, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
