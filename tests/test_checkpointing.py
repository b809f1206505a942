"""Checkpoints hold only what trains, and such a checkpoint resumes: in one file, and from a
sharded (torch distributed) folder, whose loader otherwise asks for every tensor of the model."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from lightning_mem.checkpointing import check_trainable_kept, keep_trainable, load_sharded_checkpoint, saved_module_keys


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[0].requires_grad_(False)  # the frozen part: a base, a reference
    return model


def _trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _model(seed)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model(torch.ones(3, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_keep_trainable_cuts_the_state_dict_to_trainable_parameters():
    model = _model(0)
    checkpoint = {"state_dict": model.state_dict(), "global_step": 3}
    keep_trainable(model, checkpoint)
    assert set(checkpoint["state_dict"]) == {"1.weight", "1.bias"} and checkpoint["global_step"] == 3
    check_trainable_kept(model, checkpoint)
    del checkpoint["state_dict"]["1.bias"]
    with pytest.raises(KeyError, match=r"lacks 1 trainable tensors, e\.g\. \['1\.bias'\]"):
        check_trainable_kept(model, checkpoint)
    # A strategy that saves the weights itself (DeepSpeed) leaves no state_dict: nothing to do.
    no_weights = {"global_step": 3}
    keep_trainable(model, no_weights)
    check_trainable_kept(model, no_weights)
    assert no_weights == {"global_step": 3}


def test_a_sharded_checkpoint_of_what_trains_resumes_weights_and_optimizer(tmp_path):
    model, optimizer = _trained(0)
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    checkpoint = {"state_dict": model.state_dict()}
    keep_trainable(model, checkpoint)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"state_dict": checkpoint["state_dict"], "optimizer_0": get_optimizer_state_dict(model, optimizer)},
                 checkpoint_id=str(tmp_path))
        assert saved_module_keys(tmp_path) == {"1.weight", "1.bias"}

        fresh = _model(1)  # another start: its frozen part stays as it was loaded
        frozen_before = fresh[0].weight.detach().clone()
        fresh_optimizer = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=0.1)
        fresh(torch.ones(3, 4)).sum().backward()
        fresh_optimizer.step()  # its own state, to be overwritten
        fresh_optimizer.zero_grad()
        load_sharded_checkpoint(fresh, [fresh_optimizer], tmp_path, strict=False)
        assert torch.equal(fresh[1].weight, model[1].weight) and torch.equal(fresh[1].bias, model[1].bias)
        assert torch.equal(fresh[0].weight, frozen_before)
        want, got = optimizer.state_dict()["state"], fresh_optimizer.state_dict()["state"]
        for slot in want:
            for name in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(got[slot][name], want[slot][name]), (slot, name)

        with pytest.raises(KeyError, match=r"lacks 2 of the model's tensors \(e\.g\. \['0\.bias', '0\.weight'\]\)"):
            load_sharded_checkpoint(_model(2), [], tmp_path, strict=True)


def test_checkpoint_metadata_is_the_file_lightning_loads():
    # The sharded checkpoint's metadata file must be the one ModelParallelStrategy.load_checkpoint reads.
    from lightning.fabric.utilities.load import _METADATA_FILENAME

    from lightning_mem.checkpointing import CHECKPOINT_METADATA

    assert CHECKPOINT_METADATA == _METADATA_FILENAME
