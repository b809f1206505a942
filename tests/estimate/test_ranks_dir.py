"""Ranks spawned by ``run_ranks`` share one folder that outlives every rank: a rank writes its run
files into rank 0's run folder, so a folder owned by rank 0 alone vanished under rank 1 whenever
rank 0 finished first (a loaded machine: rank 1's memory timeline failed with FileNotFoundError)."""

import os
import time
from pathlib import Path

from lightning_mem.estimate.sharded import SHARED_DIR_ENV, run_ranks


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
