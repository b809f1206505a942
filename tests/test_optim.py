"""Optimizer helpers: parameter groups, exact state bytes per parameter, step in backward, and whether a
paged optimizer pages (the platform query replaced, both answers)."""

from __future__ import annotations

import math
import warnings

import bitsandbytes as bnb
import pytest
import torch
from memtest_utils import lm_loss, tiny_llama, token_batches
from torch import nn

from lightning_mem import optim as optim_module
from lightning_mem.optim import StepInBackward, optimizer_state_bytes, param_groups


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


def test_step_in_backward_refuses_parameters_outside_the_module() -> None:
    model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="not in the module"):
        StepInBackward(model, torch.optim.AdamW([nn.Parameter(torch.zeros(2))]))


# -- step in backward with bitsandbytes' optimizers ----------------------------------------------
# min_8bit_size=40,000 splits the tiny Llama: q/o projections, MLP and embeddings (65,536 values and
# more) get 8-bit state; k/v projections (32,768) and norms get 32-bit state, in both runs.
_BNB_IN_BACKWARD = {
    "AdamW8bit": lambda params: bnb.optim.AdamW8bit(params, lr=2e-3, betas=(0.8, 0.99), eps=1e-6, min_8bit_size=40_000),
    "PagedAdamW8bit": lambda params: bnb.optim.PagedAdamW8bit(params, lr=2e-3, betas=(0.8, 0.99), min_8bit_size=40_000),
    "PagedAdamW": lambda params: bnb.optim.PagedAdamW(params, lr=2e-3, weight_decay=0.1),
}


def _bnb_after_backward(make, batches):
    model = tiny_llama(layers=2)
    optimizer = make(param_groups(model, 0.05))
    page_where_supported(optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    for ids in batches:
        lm_loss(model, ids).backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return model, optimizer


@pytest.mark.parametrize("name", sorted(_BNB_IN_BACKWARD))
def test_step_in_backward_with_bitsandbytes_equals_its_step_after_backward(name: str) -> None:
    batches = token_batches(3, seq=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # paged on CPU: runs unpaged, said once
        reference, reference_optimizer = _bnb_after_backward(_BNB_IN_BACKWARD[name], batches)
        model = tiny_llama(layers=2)
        template = _BNB_IN_BACKWARD[name](param_groups(model, 0.05))
        page_where_supported(template)  # the recipe's order: the paging decision, then the stepper
        schedule = torch.optim.lr_scheduler.LambdaLR(template, lambda step: 1.0 / (step + 1))
        stepper = StepInBackward(model, template)
        for ids in batches:
            lm_loss(model, ids).backward()
            assert all(p.grad is None for p in model.parameters())
            template.step()
            schedule.step()
    assert not template.state
    # Every setting reached the per-parameter optimizers: class, args, paging decision, group values.
    for opt in stepper.optimizers.values():
        assert type(opt) is type(template) and opt.is_paged is False
        assert vars(opt.args) == vars(template.args)
        assert opt.param_groups[0]["betas"] == template.param_groups[0]["betas"]
    # bitsandbytes' state is per parameter: the same tensors whether one optimizer holds them all or not.
    by_name = dict(reference.named_parameters())
    dtypes = set()
    for pname, opt in stepper.optimizers.items():
        (state,) = opt.state.values()
        expected = reference_optimizer.state[by_name[pname]]
        assert state.keys() == expected.keys() and state["step"] == expected["step"] == 3
        for key in ("state1", "state2", "absmax1", "absmax2"):
            if key in state:
                torch.testing.assert_close(state[key], expected[key], rtol=0, atol=1 if key.startswith("state") and state[key].dtype == torch.uint8 else 1e-6)
        dtypes.add(state["state1"].dtype)
    assert dtypes == ({torch.uint8, torch.float32} if name.endswith("8bit") else {torch.float32})
    for pname, param in model.named_parameters():
        torch.testing.assert_close(param, by_name[pname], rtol=1e-5, atol=1e-6, msg=pname)


def test_step_in_backward_carries_the_paging_decision() -> None:
    model = nn.Linear(4, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stepper = StepInBackward(model, bnb.optim.PagedAdamW8bit(model.parameters()))
        unpaged = bnb.optim.PagedAdamW8bit(model.parameters())
        page_where_supported(unpaged)  # no CUDA here: runs unpaged
        assert all(o.is_paged for o in stepper.optimizers.values())
        stepper.remove()
        assert not any(o.is_paged for o in StepInBackward(model, unpaged).optimizers.values())


def test_step_in_backward_keeps_one_gradient_alive_at_a_time() -> None:
    model = tiny_llama(layers=2)
    params = list(model.parameters())
    alive: list[tuple[int, int]] = []  # (bytes of every live gradient, bytes of this parameter's gradient)

    def count(param: torch.Tensor) -> None:
        alive.append((sum(p.grad.nbytes for p in params if p.grad is not None), param.numel() * param.element_size()))

    for param in params:  # registered first: runs before the step's hook, with the gradient alive
        param.register_post_accumulate_grad_hook(count)
    StepInBackward(model, bnb.optim.AdamW8bit(param_groups(model, 0.0)))
    lm_loss(model, token_batches(1, seq=16)[0]).backward()
    assert len(alive) == len(params)
    assert all(live == own for live, own in alive)
    assert max(live for live, _ in alive) == max(p.numel() * 4 for p in params)  # the embedding's fp32 gradient


def test_step_in_backward_refuses_what_it_would_lose() -> None:
    model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="bias_correction"):  # LAMB keeps these nowhere
        StepInBackward(model, bnb.optim.LAMB8bit(model.parameters()))
    manager = bnb.optim.GlobalOptimManager.get_instance()
    manager.pid2config[id(model.weight)] = {"optim_bits": 32}
    try:
        with pytest.raises(ValueError, match="GlobalOptimManager"):
            StepInBackward(model, bnb.optim.AdamW8bit(model.parameters()))
    finally:
        del manager.pid2config[id(model.weight)]


# -- paging: the paged optimizer the platform supports ------------------------------------------
# Everything below asks lightning_mem.paging's query, replaced here by both answers; the real query
# (concurrent managed access through the CUDA runtime) runs in tests/test_offload.py on a GPU.
from lightning_mem import paging  # noqa: E402
from lightning_mem.optim import page_where_supported  # noqa: E402

# Settings away from every default, so that a lost one changes the weights.
_PAGED_SETTINGS = dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05, min_8bit_size=64)


def _paging_warnings(caught: list) -> list[str]:
    return [str(w.message) for w in caught if "paging" in str(w.message) or "Paged" in str(w.message)]


def _three_steps(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=generator)
        optimizer.step()


def test_paged_optimizer_runs_unpaged_with_the_same_settings_where_the_platform_cannot_page() -> None:
    optim_module._warning_cache.clear()
    torch.manual_seed(0)
    model, reference = nn.Linear(64, 64), nn.Linear(64, 64)
    reference.load_state_dict(model.state_dict())
    asked = []
    optimizer = bnb.optim.PagedAdamW8bit(model.parameters(), **_PAGED_SETTINGS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pages = page_where_supported(optimizer, "model.optimizer", query=lambda d: asked.append(d) or False)
        _three_steps(model, optimizer)
    assert pages is False and optimizer.is_paged is False and asked == [torch.device("cpu")]
    # One line, naming the key, the optimizer that runs and why; bitsandbytes' own CPU fallback
    # warning no longer fires (the optimizer is not paged when its state is made).
    assert _paging_warnings(caught) == [
        "model.optimizer: PagedAdamW8bit runs without paging (as AdamW8bit, same settings): its parameters "
        "are on cpu, and paging needs CUDA managed memory."
    ]
    # The same run as bitsandbytes' non-paged optimizer with every setting of the config.
    _three_steps(reference, bnb.optim.AdamW8bit(reference.parameters(), **_PAGED_SETTINGS))
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)
    assert optimizer.args.min_8bit_size == 64


def test_paged_optimizer_stays_paged_where_the_platform_pages(monkeypatch) -> None:
    optim_module._warning_cache.clear()
    asked = []
    monkeypatch.setattr(paging, "paging_query", lambda device: asked.append(device) or True)  # the module's hook
    optimizer = bnb.optim.PagedAdamW32bit(nn.Linear(4, 4).parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert page_where_supported(optimizer, "model.critic_optimizer") is True
    assert optimizer.is_paged is True and asked == [torch.device("cpu")]
    assert not [m for m in _paging_warnings(caught) if "model." in m]


def test_paging_decision_names_the_key_once_and_leaves_unpaged_optimizers_alone(monkeypatch) -> None:
    optim_module._warning_cache.clear()
    monkeypatch.setattr(paging, "paging_query", lambda device: pytest.fail("an unpaged optimizer asks nothing"))
    assert page_where_supported(torch.optim.AdamW(nn.Linear(4, 4).parameters())) is False
    assert page_where_supported(bnb.optim.AdamW8bit(nn.Linear(4, 4).parameters())) is False
    monkeypatch.setattr(paging, "paging_query", lambda device: False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            paged = bnb.optim.PagedAdamW8bit(nn.Linear(4, 4).parameters())
            assert page_where_supported(paged, "model.critic_optimizer") is False
    messages = _paging_warnings(caught)
    assert len(messages) == 1 and messages[0].startswith("model.critic_optimizer: PagedAdamW8bit runs without paging")


def test_paging_decision_comes_before_any_paged_state() -> None:
    model = nn.Linear(4, 4)
    optimizer = bnb.optim.PagedAdamW8bit(model.parameters())
    paged = torch.zeros(4, 4, dtype=torch.uint8)
    paged.is_paged, paged.page_deviceid = True, 0  # what bitsandbytes' paged buffers carry
    optimizer.state[model.weight]["state1"] = paged
    with pytest.raises(ValueError, match=r"^model\.optimizer: PagedAdamW8bit already holds paged state.*first step"):
        page_where_supported(optimizer, query=lambda d: False)


def test_the_default_platform_query_says_no_without_cuda() -> None:
    assert paging.paging_query is paging.concurrent_managed_access
    assert paging.paging_supported("cpu") is False
    if not torch.cuda.is_available():
        assert paging.paging_supported("cuda:0") is False
    assert paging.paging_supported("cpu", query=lambda d: True) is True
    reason = paging.no_paging_reason(torch.device("cuda", 0))
    assert "cuda:0 has no concurrent managed access" in reason and "cudaDevAttrConcurrentManagedAccess" in reason


@pytest.mark.parametrize("can_page", [False, True], ids=["cannot-page", "pages"])
def test_ppo_decides_paging_for_both_optimizers_before_any_state(monkeypatch, can_page: bool) -> None:
    """The recipe's configure_optimizers asks the platform for each optimizer, naming its own key."""
    import recipes.ppo as ppo
    from lightning_mem.rl.config import CriticConfig
    from recipes.rewards import ArithmeticReward
    from tests.helpers import TINY_MODEL

    optim_module._warning_cache.clear()
    monkeypatch.setattr(paging, "paging_query", lambda device: can_page)
    module = ppo.PPOModule(
        name_or_path=str(TINY_MODEL), reward=ArithmeticReward(), critic=CriticConfig(layout="separate"), export_dir=None,
        optimizer=lambda params: bnb.optim.PagedAdamW8bit(params, lr=1e-5),
        critic_optimizer=lambda params: bnb.optim.PagedAdamW32bit(params, lr=1e-5),
    )
    module.configure_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        actor, critic = module.configure_optimizers()
    assert (actor.is_paged, critic.is_paged) == (can_page, can_page)
    assert sorted(m.split(":")[0] for m in _paging_warnings(caught) if m.startswith("model.")) == (
        [] if can_page else ["model.critic_optimizer", "model.optimizer"]
    )
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
