"""Shared pytest setup: the `gpu` marker skips without CUDA; tests never reach a network; every test
starts from the same random state."""

from __future__ import annotations

import importlib.util
import os
import random

import pytest
import torch

# Nothing in the suite may download: the tiny model and data ship in the repo.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if importlib.util.find_spec("vllm") is None:
        # vLLM lives in its own venv (`make vllm-install`; `make test` runs these there).
        skip_vllm = pytest.mark.skip(reason="needs vLLM: `make vllm-install`, then `.venv-vllm/bin/python -m pytest -m vllm`")
        for item in items:
            if "vllm" in item.keywords:
                item.add_marker(skip_vllm)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _isolated_process_state():
    """Undo what in-process runs leave behind for later tests, and seed each one alike.

    A LightningCLI run sets PL_GLOBAL_SEED (which seeds the DistributedSampler of every later
    2-rank subprocess), and a distributed strategy built in-process (a DDP trainer failing at
    setup, say) sets MASTER_PORT and leaves a process group listening on it (later subprocesses
    would inherit the port and fail with EADDRINUSE). Restore the environment and destroy the group.
    """
    before = dict(os.environ)
    # The same random state at every test's start, whatever ran before it: an unseeded draw (a
    # randn whose error is compared to a bound) otherwise depends on the test order and on -k.
    torch.manual_seed(0)
    random.seed(0)
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    if os.environ != before:
        os.environ.clear()
        os.environ.update(before)


@pytest.fixture(scope="session")
def sft_export(tmp_path_factory):
    """The SFT demo run (configs/sft/tiny_cpu.yaml, 600 steps, about 2 minutes), made once a session:
    the policy PPO and DPO start from and the backbone the tiny reward model starts from."""
    from tests.helpers import REPO, run_recipe

    root = tmp_path_factory.mktemp("sft")
    sft = run_recipe(
        "sft", "fit", "--config", str(REPO / "configs" / "sft" / "tiny_cpu.yaml"), f"--trainer.default_root_dir={root}",
        "--trainer.logger=false", "--trainer.callbacks=[]", "--trainer.val_check_interval=600",
    )
    assert sft.returncode == 0, sft.stderr[-3000:]
    return root / "export"
