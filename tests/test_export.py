"""One way to get a trained model's weights for export, whatever strategy trained it: a strategy
that spreads weights over ranks gathers them through its ``full_state_dict``; any other
strategy's module is whole, and its tensors are copied to the host."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from lightning_mem.export import GathersStateDict, full_state_dict, gather_state_dict, local_state_dict


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Linear(3, 1))
    model[0].requires_grad_(False)  # a frozen base
    return model


class _Gathering:
    """A stand-in for a sharding strategy: records what it was asked for."""

    def __init__(self) -> None:
        self.calls: list[bool] = []

    def full_state_dict(self, module: nn.Module, *, trainable_only: bool = False) -> dict[str, torch.Tensor]:
        self.calls.append(trainable_only)
        return {"gathered": torch.zeros(1)}


def test_a_sharding_strategy_gathers_and_any_other_strategy_copies():
    model = _model()
    sharded = _Gathering()
    assert isinstance(sharded, GathersStateDict) and not isinstance(object(), GathersStateDict)
    trainer = SimpleNamespace(strategy=sharded, is_global_zero=True)
    assert set(gather_state_dict(trainer, model, trainable_only=True)) == {"gathered"} and sharded.calls == [True]

    plain = SimpleNamespace(strategy=object(), is_global_zero=True)
    state = gather_state_dict(plain, model)
    assert list(state) == list(model.state_dict())
    assert all(t.device.type == "cpu" and torch.equal(t, model.state_dict()[k]) for k, t in state.items())
    assert gather_state_dict(SimpleNamespace(strategy=object(), is_global_zero=False), model) is None


def test_trainable_only_is_the_trainable_parameters_and_nothing_else():
    model = _model()
    want = {"1.weight", "1.bias", "2.weight", "2.bias"}  # no frozen layer, no BatchNorm buffers
    assert set(local_state_dict(model, trainable_only=True)) == want
    assert set(full_state_dict(model, trainable_only=True)) == want
    assert set(full_state_dict(model)) == set(model.state_dict())
