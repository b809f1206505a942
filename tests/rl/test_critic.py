"""The separate critic loads its backbone out of a causal-LM checkpoint quietly, with the policy's
weights, and warns when the checkpoint lacks backbone weights."""

from __future__ import annotations

import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from lightning_mem.models import load_causal_lm
from lightning_mem.rl.critic import load_value_model
from tests.helpers import TINY_MODEL


@pytest.fixture
def policy_dir(tmp_path):
    torch.manual_seed(0)
    load_causal_lm(str(TINY_MODEL)).save_pretrained(tmp_path)
    return tmp_path


def test_backbone_has_the_policy_weights_and_no_warning(policy_dir):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        critic = load_value_model(str(policy_dir))
    policy = load_file(policy_dir / "model.safetensors")
    backbone = critic.backbone.state_dict()
    assert set(backbone) == {k.removeprefix("model.") for k in policy if k != "lm_head.weight"}
    for name, value in backbone.items():
        assert torch.equal(value, policy[f"model.{name}"]), name


def test_missing_backbone_weights_are_named(policy_dir):
    weights = load_file(policy_dir / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, policy_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.warns(UserWarning, match=r"`model.critic.name_or_path` \(.*\): the checkpoint has no weights for norm.weight; they start at random"):
        load_value_model(str(policy_dir), key="model.critic.name_or_path")  # the key the PPO recipe passes


def test_value_function_layouts():
    """The shared head reads the actor's hidden states and joins the actor's optimizer; the
    separate critic runs its own backbone and has an optimizer of its own."""
    from lightning_mem.rl.critic import SeparateCritic, SharedHead, critic_values, value_function
    from lightning_mem.rl.rollout import Experience, policy_forward

    torch.manual_seed(0)
    actor = load_causal_lm(str(TINY_MODEL))
    exp = Experience(input_ids=torch.tensor([[5, 6, 7, 8]]), attention_mask=torch.ones(1, 4, dtype=torch.long),
                     prompt_lengths=torch.tensor([2]), response_ids=torch.tensor([[7, 8]]),
                     response_mask=torch.ones(1, 2, dtype=torch.long), group_ids=torch.tensor([0]))

    shared = value_function("shared")
    assert isinstance(shared, SharedHead) and shared.reads_actor_hidden and not shared.has_own_optimizer
    head = shared.build(actor, lambda: pytest.fail("the shared layout loads no critic"))
    torch.nn.init.normal_(head.summary.weight)
    hidden = policy_forward(actor, exp, with_hidden=True, chunk_size=None).hidden
    assert torch.equal(shared.values(exp, hidden), head(hidden))
    assert shared.actor_param_groups() == [{"params": [head.summary.weight, head.summary.bias], "weight_decay": 0.0}]
    with pytest.raises(ValueError, match="reads the actor's hidden states"):
        shared.values(exp, None)

    separate = value_function("separate")
    assert isinstance(separate, SeparateCritic) and not separate.reads_actor_hidden and separate.has_own_optimizer
    critic = separate.build(actor, lambda: load_value_model(str(TINY_MODEL)))
    torch.nn.init.normal_(critic.value_head.summary.weight)
    assert torch.equal(separate.values(exp, hidden), critic_values(critic, exp))
    assert separate.actor_param_groups() == []
    with pytest.raises(ValueError, match="critic layout must be one of"):
        value_function("both")
