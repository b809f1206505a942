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
