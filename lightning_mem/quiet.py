"""Warnings a user of the recipes cannot act on, silenced with the reason for each.

A run should print only what asks for an action; each entry here is a message that every run of
a recipe would print although nothing in the user's config causes or could fix it. Anything not
listed still prints.
"""

from __future__ import annotations

import logging
import os
import warnings

#: (message regex, why it does not apply to the recipes)
UNACTIONABLE: tuple[tuple[str, str], ...] = (
    (
        r"You're resuming from a checkpoint that ended before the epoch ended and your dataloader is not resumable",
        "TokenBudgetSampler resumes by position (the batches already run), so a mid-epoch resume sees exactly"
        " the batches an uninterrupted run would",
    ),
    (
        r"Starting from v1\.9\.0, `tensorboardX` has been removed",
        "a note about Lightning's default logger choice, printed on every run that keeps the default",
    ),
    (
        r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        "raised inside Lightning's own code under torch >= 2.10, once per rank",
    ),
    (
        r"torch\.distributed\.nn\.functional\.all_gather is deprecated",
        "raised inside Lightning's all_gather (LightningModule.all_gather) under torch 2.13, once per rank",
    ),
    (
        r"`is_gradient_checkpointing` is deprecated",
        "raised inside peft's prepare_model_for_kbit_training under transformers 5",
    ),
    (
        r"Paged optimizers are not supported on CPU",
        "bitsandbytes' duplicate of lightning_mem.optim's own warning, which names the optimizer",
    ),
    (
        r"The '\w+' does not have many workers which may be a bottleneck",
        "the recipes' data modules tokenize once into a memory-mapped Arrow cache, so a batch is an index"
        " lookup and a pad; worker processes would copy it without making a step faster (a rollout or a"
        " forward dominates). `data.num_workers` still sets them, for a custom source that is slow to read",
    ),
)

#: Lightning's float32-matmul tip (CUDA cards with tensor cores, matmul precision 'highest').
_MATMUL_TIP = (
    "You are using a CUDA device",
    "Lightning's tip to call torch.set_float32_matmul_precision('high'), printed on every Ampere or later"
    " card: the project keeps fp32 matmuls at fp32 on purpose -- precision is what the config says, and a"
    " `32-true` run that silently computed in TF32 would not be one. The compute dtype is chosen in the"
    " YAML (`trainer.precision`, FSDP2's `param_dtype`); every shipped GPU config computes in bf16, where"
    " the setting does not apply",
)

#: (logger, message prefix, why): log records of other libraries, dropped the same way.
UNACTIONABLE_LOGS: tuple[tuple[str, str, str], ...] = (
    (
        "lightning.pytorch.utilities.rank_zero",
        "💡 Tip: For seamless cloud",
        "Lightning's advertisement for its optional cloud logger (litlogger) and model registry (litmodels),"
        " printed by every run that does not use them; the run's logs and checkpoints do not depend on them",
    ),
    (
        "DeepSpeed",
        "Setting accelerator to CPU",
        "printed when `deepspeed` is imported on a machine without CUDA: transformers' save_pretrained"
        " (through accelerate) imports it at every export, DeepSpeed strategy or not; Lightning's own"
        " 'GPU available: False' line already says which device the run uses",
    ),
    # The tip goes through lightning_utilities' rank_zero logger, which ever Lightning package named last.
    ("lightning.pytorch.utilities.rank_zero", *_MATMUL_TIP),
    ("lightning.fabric.utilities.rank_zero", *_MATMUL_TIP),
    (
        "bitsandbytes.backends.cpu.ops",
        "Failed to load CPU gemm_4bit_forward from kernels-community",
        "an optional CPU kernel that bitsandbytes would download from the hub at run time; the"
        " built-in kernel is used, with the same results",
    ),
)

_installed = False


class _DropPrefix(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def silence_unactionable_warnings() -> None:
    """Install ignore filters for :data:`UNACTIONABLE` and :data:`UNACTIONABLE_LOGS` (process-wide, once).

    Called when :mod:`lightning_mem.cli` is imported, i.e. before a recipe imports bitsandbytes.
    """
    global _installed
    if _installed:
        return
    _installed = True
    for pattern, _reason in UNACTIONABLE:
        warnings.filterwarnings("ignore", message=pattern)
    for name, prefix, _reason in UNACTIONABLE_LOGS:
        logging.getLogger(name).addFilter(_DropPrefix(prefix))
    # transformers 5 draws a progress bar per shard on every load and save ("Loading weights",
    # "Writing model shards"): a tiny model's bars flash by, a big one's shard count is not
    # progress a user can act on; the recipes report their own steps. HF_HUB_DISABLE_PROGRESS_BARS=0
    # (or transformers' enable_progress_bar()) brings them back.
    if os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS") != "0":
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
