"""Lightning's two GPU-run tips that a recipe user cannot act on are dropped, as Lightning prints
them; a line next to them is kept."""

from __future__ import annotations

import logging
import warnings

from lightning_mem.quiet import silence_unactionable_warnings


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_lightnings_matmul_precision_tip_is_dropped(monkeypatch):
    from lightning.fabric.utilities.rank_zero import rank_zero_info as fabric_info
    from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
    from lightning_utilities.core import rank_zero

    silence_unactionable_warnings()
    tip = ("You are using a CUDA device ('NVIDIA H100 80GB HBM3') that has Tensor Cores. To properly utilize them,"
           " you should set `torch.set_float32_matmul_precision('medium' | 'high')`")
    # What the filters decide, whatever earlier tests of this process left behind (a Lightning
    # logger's level, its propagation, the rank Lightning thinks it is): the records are caught on
    # the logger Lightning's helpers write to, on rank 0, at INFO.
    logger, kept = rank_zero.log, _Kept()
    monkeypatch.setattr(rank_zero_only, "rank", 0)
    monkeypatch.setattr(logger, "level", logging.INFO)
    monkeypatch.setattr(logger, "disabled", False)
    logger.addHandler(kept)
    try:
        fabric_info(tip)  # lightning.fabric.accelerators.cuda's own import
        rank_zero_info(tip)
        rank_zero_info("LOCAL_RANK: 0 - CUDA_VISIBLE_DEVICES: [0]")
    finally:
        logger.removeHandler(kept)
    assert kept.messages == ["LOCAL_RANK: 0 - CUDA_VISIBLE_DEVICES: [0]"]


def test_lightnings_num_workers_tip_is_dropped(monkeypatch):
    from lightning.fabric.utilities.warnings import PossibleUserWarning
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn

    from lightning_mem import quiet

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monkeypatch.setattr(quiet, "_installed", False)  # installed again, inside this block's filters
        silence_unactionable_warnings()
        rank_zero_warn("The 'train_dataloader' does not have many workers which may be a bottleneck. Consider"
                       " increasing the value of the `num_workers` argument` to `num_workers=15` in the"
                       " `DataLoader` to improve performance.", category=PossibleUserWarning)
        rank_zero_warn("The 'train_dataloader' holds 3 batches", category=PossibleUserWarning)
    assert [str(w.message) for w in caught] == ["The 'train_dataloader' holds 3 batches"]
