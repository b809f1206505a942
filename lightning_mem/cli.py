"""The LightningCLI shared by the recipes: a checkpoint section whose folder follows the run's root.

``checkpoint.dirpath`` is derived from ``trainer.default_root_dir`` so that moving a run (one
override on the command line) moves its checkpoints too, and ``--ckpt_path last`` finds them.
"""

from __future__ import annotations

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI


def _checkpoint_dir(default_root_dir: str | None) -> str:
    return f"{default_root_dir or '.'}/checkpoints"


class RecipeCLI(LightningCLI):
    """LightningCLI with a ``checkpoint`` section (ModelCheckpoint) and the tokenizer linked to the model."""

    #: Recipes whose datamodule loads a tokenizer link it to the model's path.
    link_tokenizer = True

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.set_defaults({"checkpoint.save_last": True, "checkpoint.save_top_k": 0})
        parser.link_arguments("trainer.default_root_dir", "checkpoint.dirpath", compute_fn=_checkpoint_dir)
        if self.link_tokenizer:
            parser.link_arguments("model.name_or_path", "data.tokenizer")
