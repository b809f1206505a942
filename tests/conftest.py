"""Shared pytest setup: the `gpu` marker skips without CUDA; tests never reach a network."""

from __future__ import annotations

import os

import pytest
import torch

# Nothing in the suite may download: the tiny model and data ship in the repo.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# Variables Lightning and torch.distributed set in the process that launches or joins a group.
_DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE",
             "GROUP_RANK", "TORCHELASTIC_RUN_ID")


@pytest.fixture(autouse=True)
def _no_distributed_leftovers():
    """A test that builds a distributed strategy in-process (a DDP trainer failing at setup, say)
    leaves a process group listening on MASTER_PORT and the variable in os.environ; every later
    2-rank subprocess would inherit the port and fail with EADDRINUSE. Undo both after each test."""
    before = {k: os.environ.get(k) for k in _DIST_ENV}
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
