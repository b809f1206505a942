"""Ranks spawned by ``run_ranks`` share one folder that outlives every rank: a rank writes its run
files into rank 0's run folder, so a folder owned by rank 0 alone vanished under rank 1 whenever
rank 0 finished first (a loaded machine: rank 1's memory timeline failed with FileNotFoundError)."""

import os
import time
from pathlib import Path

import pytest

from lightning_mem.estimate.sharded import SHARED_DIR_ENV, run_ranks
from lightning_mem.settings import SettingError


def _write_late(*, world_size: int) -> list:
    rank = int(os.environ["RANK"])
    shared = Path(os.environ[SHARED_DIR_ENV])
    if rank == 1:
        time.sleep(1.0)  # rank 0 has returned (and cleaned up whatever was its own) by now
    (shared / "run").mkdir(exist_ok=True)
    (shared / "run" / f"rank{rank}.csv").write_text("x\n")
    assert sorted(p.name for p in (shared / "run").iterdir())[: rank + 1] == [f"rank{r}.csv" for r in range(rank + 1)]
    return []


def test_every_rank_writes_into_one_folder_that_outlives_rank_zero():
    assert run_ranks(_write_late, (), world_size=2, timeout=300) == [[], []]


def _refuse_a_setting(*, world_size: int) -> list:
    raise SettingError("trainer.devices", f": refused on rank {os.environ['RANK']} of {world_size}")


def test_a_ranks_setting_error_crosses_back_as_itself():
    # A sharded estimate's ranks run the recipe: its one-line errors must reach the command line as
    # they are, not as "ranks failed" with each rank's traceback.
    with pytest.raises(SettingError, match=r"^`trainer.devices`: refused on rank 0 of 2$"):
        run_ranks(_refuse_a_setting, (), world_size=2, timeout=300)
