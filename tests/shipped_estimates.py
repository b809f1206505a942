"""One estimate of a shipped config per test process: the gate's tests that read the same config share it.

The H100 check of ``configs/ppo/qwen2.5-0.5b-instruct_1x24gb.yaml`` estimates it with the rollout path
that was measured (``generate``), which the shipped config no longer runs, so today only the config
gate reads these; a later test that reads the same config as shipped carries ``PPO_0_5B_GROUP``, so
``make test-gate`` (``--dist loadgroup``) runs it in the gate's worker and reads the gate's estimate.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

#: The xdist group of the PPO 0.5B config's tests (the gate's and the H100 check).
PPO_0_5B_GROUP = "ppo-0.5b-estimate"
#: The xdist group of the DPO 8B LoRA config's tests (the gate's and its reference's cost).
DPO_8B_GROUP = "dpo-8b-estimate"


def shipped_estimate(path: Path, world_size: int) -> Any:
    """``estimate(path, [], world_size=world_size)``, computed once per process (read it, do not change it)."""
    return _estimate(Path(path).resolve(), world_size)


@functools.cache
def _estimate(path: Path, world_size: int) -> Any:
    from lightning_mem.estimate import estimate

    return estimate(path, [], world_size=world_size)
