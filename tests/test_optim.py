"""Optimizer helpers: parameter groups, exact state bytes per parameter, paged warning, step in backward."""

from __future__ import annotations

import math
import warnings

import bitsandbytes as bnb
import pytest
import torch
from memtest_utils import lm_loss, tiny_llama, token_batches
from torch import nn

from lightning_mem import optim as optim_module
from lightning_mem.optim import StepInBackward, optimizer_state_bytes, param_groups, warn_if_paged_on_cpu


def _step_once(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.ones_like(p)
    optimizer.step()


def test_param_groups_trainable_only_no_decay_on_norms_and_biases() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2, bias=False))
    model[2].weight.requires_grad_(False)
    decay, no_decay = param_groups(model, weight_decay=0.1)
    assert decay == {"params": [model[0].weight], "weight_decay": 0.1}
    assert no_decay["weight_decay"] == 0.0
    assert no_decay["params"] == [model[0].bias, model[1].weight, model[1].bias]
    # None: the decayed group leaves weight decay to the optimizer's own (YAML) setting.
    decay, _ = param_groups(model, weight_decay=None)
    assert "weight_decay" not in decay
    assert torch.optim.AdamW(param_groups(model, None), weight_decay=0.3).param_groups[0]["weight_decay"] == 0.3
    with pytest.raises(ValueError, match="no trainable parameters"):
        param_groups(model.requires_grad_(False), 0.1)


def test_llama_norms_get_no_decay() -> None:
    model = tiny_llama()
    decay, no_decay = param_groups(model, 0.01)
    names = {id(p): n for n, p in model.named_parameters()}
    assert all("norm" in names[id(p)] for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_adamw_state_is_exactly_8_bytes_per_parameter() -> None:
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters())
    _step_once(model, optimizer)
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    state = optimizer_state_bytes(optimizer)
    # exp_avg + exp_avg_sq in fp32, plus one 4-byte scalar `step` per parameter tensor.
    assert state == 8 * numel + 4 * len(params)
    assert round(state / numel, 3) == 8.0


def test_bitsandbytes_8bit_state_is_at_most_2_1_bytes_per_parameter() -> None:
    model = tiny_llama()
    optimizer = bnb.optim.AdamW8bit(model.parameters())
    _step_once(model, optimizer)
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    # Tensors with >= min_8bit_size (4096) elements: two uint8 states plus two fp32 absmax per
    # 256-element block; smaller ones (the norms) keep two fp32 states. Plus the two shared
    # 256-entry fp32 quantization maps.
    expected = 2 * 256 * 4
    for p in params:
        n = p.numel()
        expected += 2 * n + 2 * 4 * math.ceil(n / 256) if n >= 4096 else 8 * n
    state = optimizer_state_bytes(optimizer)
    assert state == expected
    assert state / numel <= 2.1


def test_warn_if_paged_on_cpu_warns_once() -> None:
    optim_module._warning_cache.clear()
    plain = bnb.optim.AdamW8bit(nn.Linear(4, 4).parameters())
    paged = bnb.optim.PagedAdamW8bit(nn.Linear(4, 4).parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert warn_if_paged_on_cpu(plain) is False
        assert warn_if_paged_on_cpu(torch.optim.AdamW(nn.Linear(4, 4).parameters())) is False
        assert warn_if_paged_on_cpu(paged) is True
        assert warn_if_paged_on_cpu(paged) is True
    messages = [str(w.message) for w in caught if "paging needs CUDA" in str(w.message)]
    assert len(messages) == 1 and "PagedAdamW8bit" in messages[0]


# -- step in backward --------------------------------------------------------------------------
def test_step_in_backward_equals_adamw_and_frees_gradients() -> None:
    batches = token_batches(3)
    reference = tiny_llama()
    optimizer = torch.optim.AdamW(param_groups(reference, 0.01), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    for ids in batches:
        lm_loss(reference, ids).backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()

    model = tiny_llama()
    template = torch.optim.AdamW(param_groups(model, 0.01), lr=1e-3)
    template_scheduler = torch.optim.lr_scheduler.LambdaLR(template, lambda step: 1.0 / (step + 1))
    stepper = StepInBackward(model, template)
    for ids in batches:
        lm_loss(model, ids).backward()
        assert all(p.grad is None for p in model.parameters())  # each freed right after its step
        template.step()  # what Lightning does: no gradients, so nothing happens
        template_scheduler.step()  # the per-parameter optimizers follow the schedule
    assert not template.state
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)

    state = stepper.state_dict()
    assert set(state) == {n for n, _ in model.named_parameters()}
    fresh = StepInBackward(model, template)
    fresh.load_state_dict(state)
    name = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(fresh.optimizers[name].state_dict()["state"][0]["exp_avg"], state[name]["state"][0]["exp_avg"])
    stepper.remove()
    fresh.remove()
    lm_loss(model, batches[0]).backward()
    assert all(p.grad is not None for p in model.parameters())  # hooks gone: normal accumulation


def test_step_in_backward_refuses_optimizers_with_settings_outside_defaults() -> None:
    model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="min_8bit_size"):
        StepInBackward(model, bnb.optim.AdamW8bit(model.parameters()))
    with pytest.raises(ValueError, match="not in the module"):
        StepInBackward(model, torch.optim.AdamW([nn.Parameter(torch.zeros(2))]))


# -- bitsandbytes optimizers on sharded parameters (the 2-rank runs: tests/strategies/test_bnb_fsdp2.py)
def test_step_local_shards_keeps_the_object_and_plain_tensor_steps_unchanged() -> None:
    from lightning_mem.optim import LocalShardStep, step_local_shards

    torch_adamw = torch.optim.AdamW(nn.Linear(4, 4).parameters())
    assert step_local_shards(torch_adamw) is torch_adamw and type(torch_adamw) is torch.optim.AdamW

    torch.manual_seed(0)
    plain, adapted = nn.Linear(256, 64), nn.Linear(256, 64)
    adapted.load_state_dict(plain.state_dict())
    ref = bnb.optim.PagedAdamW8bit(plain.parameters(), lr=1e-2)
    opt = bnb.optim.PagedAdamW8bit(adapted.parameters(), lr=1e-2)
    assert step_local_shards(opt) is opt and step_local_shards(opt) is opt  # idempotent
    assert isinstance(opt, LocalShardStep) and isinstance(opt, bnb.optim.PagedAdamW8bit)
    assert type(opt).__name__ == "PagedAdamW8bit"
    for _ in range(2):
        for model, optimizer in ((plain, ref), (adapted, opt)):
            model(torch.ones(2, 256)).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), adapted.parameters()))
    assert optimizer_state_bytes(opt) == optimizer_state_bytes(ref)
