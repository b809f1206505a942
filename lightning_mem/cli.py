"""The LightningCLI shared by the recipes: a checkpoint section whose folder follows the run's root.

``checkpoint.dirpath`` is derived from ``trainer.default_root_dir`` so that moving a run (one
override on the command line) moves its checkpoints too, and ``--ckpt_path last`` finds them.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar, TQDMProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_mem.callbacks.progress import StepProgressBar, StepRichProgressBar
from lightning_mem.checkpointing import AtomicCheckpointIO, ResumeCheck, find_last_checkpoint
from lightning_mem.quiet import silence_unactionable_warnings


# Before a recipe imports bitsandbytes (it logs at import): recipes import this module first.
silence_unactionable_warnings()


def _checkpoint_dir(default_root_dir: str | None) -> str:
    return f"{default_root_dir or '.'}/checkpoints"


class RecipeCLI(LightningCLI):
    """LightningCLI with a ``checkpoint`` section (ModelCheckpoint) and the tokenizer linked to the model.

    Only the subcommands a recipe supports are offered (``fit``, and ``validate`` where the module
    has a validation step), and no top-level ``--optimizer``/``--lr_scheduler``: the recipes take
    theirs as ``model.optimizer``/``model.lr_scheduler``.
    """

    #: Recipes whose datamodule loads a tokenizer link it to the model's path.
    link_tokenizer = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # LightningCLI's own --optimizer would build an optimizer over the module's parameters
        # before configure_model has created any (an empty parameter list).
        kwargs.setdefault("auto_configure_optimizers", False)
        silence_unactionable_warnings()
        super().__init__(*args, **kwargs)

    def subcommands(self) -> dict[str, set[str]]:  # type: ignore[override]
        # No recipe has a test_step or predict_step: those subcommands could only crash.
        commands = {"fit": {"model", "train_dataloaders", "val_dataloaders", "datamodule"}}
        if getattr(self._model_class, "validation_step", None) is not LightningModule.validation_step:
            commands["validate"] = {"model", "dataloaders", "datamodule"}
        return commands

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.set_defaults({"checkpoint.save_last": True, "checkpoint.save_top_k": 0})
        parser.link_arguments("trainer.default_root_dir", "checkpoint.dirpath", compute_fn=_checkpoint_dir)
        if self.link_tokenizer:
            parser.link_arguments("model.name_or_path", "data.tokenizer")

    def before_instantiate_classes(self) -> None:
        super().before_instantiate_classes()
        check_numbers(self.config.get(str(self.subcommand), self.config))

    def before_fit(self) -> None:
        config = self.config_init["fit"]
        if config.get("ckpt_path") == "last":
            dirpath = getattr(self.trainer.checkpoint_callback, "dirpath", None) or _checkpoint_dir(
                self.trainer.default_root_dir
            )
            if find_last_checkpoint(dirpath) is None:
                # Lightning would warn too, in three lines that do not say where it looked.
                rank_zero_warn(f"--ckpt_path last: no last*.ckpt in {Path(dirpath).resolve()}; training starts from scratch")
                config["ckpt_path"] = None
        strategy = self.trainer.strategy
        if type(strategy.checkpoint_io) is TorchCheckpointIO:
            # A crash while writing last.ckpt must leave the previous one, not a truncated file.
            strategy.checkpoint_io = AtomicCheckpointIO()
        if config.get("ckpt_path"):
            keys = getattr(self.model, "optimizer_config_keys", ("model.optimizer",))
            self.trainer.callbacks.append(ResumeCheck(keys))
        _count_steps_in_progress_bar(self.trainer)


def _count_steps_in_progress_bar(trainer: Any) -> None:
    # Lightning's default bars restart every epoch and have no total for a max_steps run (the rich
    # one shows "Epoch 4/-2"); a bar the user configured is left alone.
    for i, callback in enumerate(trainer.callbacks):
        if type(callback) is TQDMProgressBar:
            trainer.callbacks[i] = StepProgressBar(
                refresh_rate=callback.refresh_rate, process_position=callback.process_position, leave=callback._leave
            )
        elif type(callback) is RichProgressBar:
            trainer.callbacks[i] = StepRichProgressBar(
                refresh_rate=callback.refresh_rate, leave=callback._leave, theme=callback.theme,
                console_kwargs=callback._console_kwargs,
            )


def check_numbers(config: Any) -> None:
    """Fail on settings that would only fail deep inside torch or Lightning, naming the key.

    ``trainer.accumulate_grad_batches`` < 1 (a ZeroDivisionError later) and any negative or
    non-finite ``...init_args.lr`` (an optimizer's or scheduler's).
    """
    flat = config.as_dict() if hasattr(config, "as_dict") else dict(config)
    accumulate = flat.get("trainer", {}).get("accumulate_grad_batches")
    if accumulate is not None and (isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1):
        raise ValueError(f"`trainer.accumulate_grad_batches` must be an int >= 1, got {accumulate!r}")

    def walk(node: Any, key: str) -> None:
        if isinstance(node, dict):
            for name, value in node.items():
                walk(value, f"{key}.{name}" if key else str(name))
        elif key.endswith("init_args.lr") and isinstance(node, (int, float)) and not isinstance(node, bool):
            if node < 0 or not math.isfinite(node):
                raise ValueError(f"`{key}` must be a finite learning rate >= 0, got {node!r}")

    walk(flat, "")
