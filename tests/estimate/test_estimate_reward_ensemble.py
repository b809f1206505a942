"""PPO's estimate with a reward-model ensemble (``model.reward_model.name_or_path`` as a list):
every member is made a config-only copy, and a second member costs exactly one more reward
model's weights in every phase (the memory plan keeps the ensemble where it keeps one)."""

from __future__ import annotations

import shutil

import torch

from lightning_mem.estimate import estimate
from tests.helpers import REPO, TINY_MODEL

CONFIG = "configs/ppo/tiny_cpu.yaml"
TINY = ["--model.name_or_path=assets/tiny-llama", "--model.reward=null"]


def _reward_model_bytes() -> int:
    """Parameter and buffer bytes of the tiny reward model (fp32 under the config's 32-true)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(TINY_MODEL, num_labels=1)
    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(config)
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def test_a_second_member_adds_one_reward_models_weights(tmp_path):
    shutil.copytree(REPO / "assets" / "tiny-llama", tmp_path / "second")  # the same architecture, another path
    one = {p.phase: p for p in estimate(CONFIG, [*TINY, "--model.reward_model.name_or_path=assets/tiny-llama"]).phases}
    two = {p.phase: p for p in estimate(
        CONFIG, [*TINY, f"--model.reward_model.name_or_path=[assets/tiny-llama, {tmp_path / 'second'}]"]).phases}
    assert list(one) == list(two) == ["rollout", "score", "train"]
    member = _reward_model_bytes()
    for phase in one:
        added = {k: two[phase].device_breakdown_bytes[k] - one[phase].device_breakdown_bytes[k]
                 for k in one[phase].device_breakdown_bytes}
        assert added["weights"] == member, phase
        assert added["gradients"] == added["optimizer_state"] == 0, phase
        # Beside it only the members' stacked scores and their std: a few bytes a sample.
        assert 0 <= two[phase].device_peak_bytes - one[phase].device_peak_bytes - member < 1024, phase
