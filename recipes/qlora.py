"""QLoRA: LoRA adapters trained on a frozen 4-bit (NF4, double-quantized) base, paged 8-bit AdamW.

    python -m recipes.qlora fit --config configs/qlora/tiny_cpu.yaml
    python -m recipes.qlora fit --config configs/qlora/tiny_cpu.yaml --ckpt_path last      # resume
    python -m recipes.qlora merge --adapter runs/qlora/tiny_cpu/export --out runs/qlora/tiny_cpu/merged

The training objective is the SFT recipe's, unchanged (this module subclasses it); what QLoRA
changes is the model: how the base is loaded and which parameters train. Step by step:

1. load the base through ``from_pretrained`` with a bitsandbytes config: each linear layer is
   quantized to 4 bits as it is read (a config-only folder first gets seeded random weights);
2. freeze everything and hold the few unquantized tensors (norms, embeddings, head) in the frozen
   role's dtype under ``trainer.precision`` (:mod:`lightning_mem.dtypes`): the compute dtype,
   so bf16 under ``bf16-mixed`` and fp32 under ``32-true``;
3. activation checkpointing per decoder block (non-reentrant);
4. peft LoRA adapters on every linear layer (or the configured ones): the only trainable tensors,
   in the precision's trained dtype (fp32 under ``32-true`` and ``*-mixed``);
5. train with the SFT loss; the optimizer (default ``PagedAdamW8bit``) sees the adapters only;
6. at the end, export the adapter in peft format with the tokenizer; ``merge`` folds it into a
   bf16 copy of the base and writes a plain Hugging Face model.

Checkpoints hold the trainable tensors only (the base is re-read from its source on resume).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import rank_zero_info

from lightning_mem.cli import RecipeCLI, run_command
from lightning_mem.dtypes import dtype_name, trainer_dtypes
from lightning_mem.data import SFTDataModule
from lightning_mem.export import export_main
from lightning_mem.logits import ChunkSize, check_supported
from lightning_mem.lora import LoraSettings, base_record, merge_main, saved_base
from lightning_mem.models import count_parameters
from lightning_mem.strategies.device_map import DeviceMapStrategy
from lightning_mem.quantization import (
    QuantizationSettings,
    check_placement,
    quantized_weight_bytes,
)
from lightning_mem.quantized_lora import load_quantized_lora
from lightning_mem.settings import SettingError, SettingNotSupported, settings_at
from recipes.sft import SFTModule


def _paged_adamw8bit(params: Any) -> torch.optim.Optimizer:
    import bitsandbytes as bnb

    # lr 2e-4: the QLoRA paper's for 7B-33B models (1e-4 for 65B+).
    return bnb.optim.PagedAdamW8bit(params, lr=2e-4)


class QLoRAModule(SFTModule):
    """The SFT objective on a quantized, frozen base with trainable LoRA adapters.

    Args:
        name_or_path: base model: local folder or hub id. A folder with only config.json (like
            ``assets/tiny-llama``) gets seeded random weights, saved under ``random_init_dir``,
            and is then loaded (and quantized) like any checkpoint.
        quantization: how the base is stored (:class:`~lightning_mem.quantization.QuantizationSettings`);
            its ``compute_dtype`` is what the 4-bit matmuls dequantize to, under any precision. The
            base's unquantized parameters are frozen in the compute dtype of ``trainer.precision``
            (bf16 under ``bf16-mixed``, fp32 under ``32-true``); the adapters train in its trained
            dtype (fp32 under ``32-true`` and ``*-mixed``).
        lora: the adapters (:class:`~lightning_mem.lora.LoraSettings`).
        activation_checkpointing: recompute each decoder block's activations in backward.
        device_map / max_memory / offload_folder: base placement for ``from_pretrained`` when it
            does not fit one device (layers on "cpu" stay unquantized in fp32, layers on "disk"
            are read from ``offload_folder`` at each forward and cannot hold adapters). None lets
            transformers put the whole base on the current device.
        random_init_dir: where a config-only base gets its random weights, relative to
            ``trainer.default_root_dir`` (absolute paths are kept).
        init_seed: seed of those random weights.
        optimizer: default ``bitsandbytes.optim.PagedAdamW8bit`` (lr 2e-4); sees adapters only.
        logits_chunk_size: as in the SFT recipe (the loss is the SFT recipe's).
        export_dir: where the adapter and tokenizer go at the end of fit, relative to
            ``trainer.default_root_dir``; None skips the export.
    """

    def __init__(
        self,
        name_or_path: str = "assets/tiny-llama",
        quantization: QuantizationSettings = QuantizationSettings(),
        lora: LoraSettings = LoraSettings(),
        activation_checkpointing: bool = True,
        device_map: str | dict[str, int | str] | None = None,
        max_memory: dict[int | str, str] | None = None,
        offload_folder: str | None = None,
        random_init_dir: str = "random_base",
        init_seed: int = 0,
        attn_implementation: str | None = None,
        trust_remote_code: bool = False,
        optimizer: OptimizerCallable = _paged_adamw8bit,
        lr_scheduler: LRSchedulerCallable | None = None,
        logits_chunk_size: ChunkSize = 512,
        export_dir: str | None = "export",
    ) -> None:
        super().__init__(
            name_or_path=name_or_path,
            attn_implementation=attn_implementation,
            trust_remote_code=trust_remote_code,
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            logits_chunk_size=logits_chunk_size,
            export_dir=export_dir,
            # The SFT module checks the targets on a meta-device twin (a typo fails in a second,
            # not after the base was read and quantized), and keeps adapter-only checkpoints.
            lora=lora,
            random_init_dir=random_init_dir,
            init_seed=init_seed,
        )
        # Replace the SFT hyperparameters (which would list its unused `dtype`) with this recipe's.
        # logger=False: the CLI logs the whole resolved config (lightning_mem.cli.RunConfigCallback).
        self.save_hyperparameters(ignore=["optimizer", "lr_scheduler"], logger=False)
        # Kept as an object: under LightningCLI, hparams hold the config's plain dicts instead (and
        # `load_from_checkpoint` passes those dicts back in).
        if isinstance(quantization, dict):
            quantization = QuantizationSettings(**quantization)
        self.quantization = quantization
        with settings_at("model"):
            check_placement(device_map, max_memory, offload_folder)

    def setup(self, stage: str) -> None:
        if getattr(self.trainer.strategy, "tensor_parallel_size", 1) > 1:
            # bitsandbytes packs a 4-bit weight into one flat buffer with per-block scales: it cannot
            # be split by rows or columns over ranks.
            raise SettingNotSupported(
                "trainer.strategy.init_args.tensor_parallel_size",
                f"={self.trainer.strategy.tensor_parallel_size}: a 4-bit base cannot be split across ranks;"
                " use `tensor_parallel_size: 1` (FSDP shards it whole), or the SFT recipe's LoRA on a 16-bit base",
            )
        super().setup(stage)
        # Before the base is loaded: a device_map spreads it over devices (and host, and disk),
        # which Lightning's usual strategies would undo by moving the whole module to one device.
        if self.hparams.device_map is not None and not isinstance(self.trainer.strategy, DeviceMapStrategy):
            raise SettingError(
                "model.device_map",
                "`model.device_map` is set, so the base must stay where from_pretrained places it: set "
                "`trainer.strategy` to `lightning_mem.strategies.DeviceMapStrategy` "
                f"(it is {type(self.trainer.strategy).__name__})"
            )

    # -- 1-4: the model -------------------------------------------------------------------------
    def configure_model(self) -> None:
        if self.model is not None:
            return
        hp = self.hparams
        base_path = saved_base(self.trainer, hp.name_or_path, hp.random_init_dir, seed=hp.init_seed)
        self.model = load_quantized_lora(
            base_path, self.quantization, self.lora, frozen_dtype=self.model_dtype(),
            trained_dtype=trainer_dtypes(self._trainer).trained, activation_checkpointing=hp.activation_checkpointing,
            device_map=hp.device_map, max_memory=hp.max_memory, offload_folder=hp.offload_folder,
            attn_implementation=hp.attn_implementation, trust_remote_code=hp.trust_remote_code,
        )  # fmt: skip
        if self.logits_chunk_size:  # a model the chunked path cannot score fails here, naming our key
            check_supported(self.model, key="model.logits_chunk_size")
        held, dense = quantized_weight_bytes(self.model)
        rank_zero_info(
            f"QLoRA: {count_parameters(self.model, trainable_only=True):,} trainable of "
            f"{count_parameters(self.model):,} parameters; quantized linear weights hold {held / 2**20:.1f} MiB "
            f"({held / dense:.3f} x their bf16 size)" if dense else "QLoRA: no quantized linear layers"
        )

    def model_dtype(self) -> torch.dtype:
        """The dtype the base's unquantized parameters are frozen in: the frozen role's under
        ``trainer.precision`` (this recipe has no ``dtype`` of its own)."""
        return trainer_dtypes(self._trainer, key="trainer.precision").load_dtype(None, role="frozen")

    # -- checkpoints (adapters only) and the adapter export: SFTModule's, with this base record --
    def adapter_base_record(self) -> dict[str, Any]:
        return base_record(
            self.quantization,
            dtype=dtype_name(self.model_dtype()),
            attn_implementation=self.hparams.attn_implementation,
            trust_remote_code=self.hparams.trust_remote_code,
        )


# ---------------------------------------------------------------------------------------------
# Command line: LightningCLI for fit/validate/..., its own parser for merge
# ---------------------------------------------------------------------------------------------


def main(args: list[str] | None = None) -> RecipeCLI | Path:
    argv = sys.argv[1:] if args is None else list(args)
    # `merge` is not a Trainer subcommand, so it is dispatched before LightningCLI sees argv.
    if argv[:1] == ["merge"]:
        return merge_main(argv[1:], prog="python -m recipes.qlora merge")
    if argv[:1] == ["export"]:
        return export_main(RecipeCLI, QLoRAModule, SFTDataModule, argv[1:])
    return RecipeCLI(QLoRAModule, SFTDataModule, args=args, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    run_command(main)
