"""Sequence parallelism with activation checkpointing: the recompute splits exactly as the forward did.

Sequence parallelism slices the first decoder block's input along the sequence in a forward
pre-hook of that block (``SequenceBoundary("enter")``); activation checkpointing recomputes the
block in backward by calling it again with the input it saved. The saved input is the slice, so
the hook must not slice it a second time (before the fix: ``The size of tensor a (6) must match
the size of tensor b (12)`` in the rotary embedding of the recompute).

One spawn of 2 gloo ranks (``model_parallel_worker.py``) runs two SFT steps of the tiny Llama
with TP2 + SP, without checkpointing and with each of the strategy's checkpointing modes (every
block, every 2nd block, the selective policy); each must log the same losses and take the same
first-step gradients as the run without checkpointing and as one process, to 1e-5 (fp32).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import model_parallel_scenarios as sc  # noqa: E402
from test_model_parallel import assert_same_gradients, assert_same_metrics, run_worker  # noqa: E402
from test_model_parallel import gradients as load_gradients  # noqa: E402

SP = {"tensor_parallel_size": 2, "sequence_parallel": True}
CHECKPOINTED = {
    "sp_ac_all": {"activation_checkpointing": True},
    "sp_ac_every2": {"activation_checkpointing": 2},
    "sp_ac_selective": {"activation_checkpointing": True, "activation_checkpointing_policy": "selective"},
}


@functools.cache
def gradients(workdir: Path, spawn: str, name: str) -> dict[str, torch.Tensor]:
    return load_gradients(workdir, spawn, name)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sp_checkpointing")


@pytest.fixture(scope="module")
def split(workdir) -> dict:
    runs = [{"name": "sp", "kind": "sft", "strategy": SP}]
    runs += [{"name": name, "kind": "sft", "strategy": {**SP, **extra}} for name, extra in CHECKPOINTED.items()]
    return run_worker(workdir / "split2", runs, devices=2)


@pytest.fixture(scope="module")
def whole(workdir) -> dict:
    out = workdir / "whole"
    out.mkdir()
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return sc.fit({"name": "sft", "kind": "sft"}, out)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("name", sorted(CHECKPOINTED))
def test_checkpointed_sequence_parallel_steps_equal_uncheckpointed_and_one_process(split, whole, workdir, name):
    reference = split["sp"][0]["metrics"]
    assert len(reference) == 2
    assert_same_metrics(reference, whole["metrics"], ("train_loss",))
    for rank in split[name]:
        assert_same_metrics(rank["metrics"], reference, ("train_loss",))
    got = gradients(workdir, "split2", name)
    assert_same_gradients(got, gradients(workdir, "split2", "sp"))
    assert_same_gradients(got, gradients(workdir, "whole", "sft"))


def test_the_first_block_is_recomputing_only_inside_its_checkpoints_backward():
    from lightning_mem.activation_checkpointing import checkpoint_block, recomputing

    block = nn.Linear(4, 4)
    seen: list[bool] = []
    block.register_forward_pre_hook(lambda m, args: seen.append(recomputing(m)))
    block(torch.ones(1, 4)).sum().backward()  # not checkpointed: never recomputing
    checkpoint_block(block)
    block(torch.ones(1, 4, requires_grad=True)).sum().backward()
    assert seen == [False, False, True]  # forward, then the recompute in backward
    assert not recomputing(block)
