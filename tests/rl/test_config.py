"""The PPO knob group's rules for the objectives: the sequence losses' default aggregation (verl's)
and the warning when a config leaves it, the covariance losses' keys and their defaults."""

from __future__ import annotations

import warnings

import pytest

from lightning_mem.rl import config as config_module
from lightning_mem.rl.config import PPOConfig
from lightning_mem.settings import SettingError


@pytest.mark.parametrize(("loss", "mode"), [("vanilla", "token-mean"), ("cispo", "token-mean"), ("clip_cov", "token-mean"),
                                            ("gspo", "seq-mean-token-mean"), ("geo_mean", "seq-mean-token-mean")])
@pytest.mark.filterwarnings("ignore:.*verl always aggregates")
def test_unset_aggregation_is_verls_for_each_loss(loss, mode):
    assert PPOConfig(policy_loss=loss).agg_mode == mode
    assert PPOConfig(policy_loss=loss, loss_agg_mode="seq-mean-token-sum").agg_mode == "seq-mean-token-sum"


def test_a_sequence_loss_with_another_mode_is_told_once(monkeypatch):
    monkeypatch.setattr(config_module, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):  # the CLI builds the group more than once
            PPOConfig(policy_loss="gspo", loss_agg_mode="token-mean")
        PPOConfig(policy_loss="gspo", loss_agg_mode="seq-mean-token-mean")  # verl's: no warning
        PPOConfig(policy_loss="gspo")
        PPOConfig(policy_loss="vanilla", loss_agg_mode="seq-mean-token-sum")  # not a sequence loss
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1
    assert messages[0].startswith("`model.ppo.loss_agg_mode: token-mean` with `policy_loss: gspo`: verl always")


def test_covariance_settings_and_their_defaults():
    assert PPOConfig(policy_loss="clip_cov").loss_options == {"ratio": 2e-4, "lower": 1.0, "upper": 5.0}
    assert PPOConfig(policy_loss="kl_cov", kl_cov_coef=0.5).loss_options == {"ratio": 2e-4, "coef": 0.5}
    assert PPOConfig(policy_loss="gspo").loss_options == {}
    with pytest.raises(SettingError, match=r"^`clip_cov_ratio` is a setting of `policy_loss: clip_cov`, not of"
                                           r" `policy_loss: vanilla`"):
        PPOConfig(clip_cov_ratio=0.01)
    with pytest.raises(SettingError, match=r"^`kl_cov_coef` is a setting of `policy_loss: kl_cov`"):
        PPOConfig(policy_loss="clip_cov", kl_cov_coef=0.1)
    with pytest.raises(SettingError, match=r"^`clip_cov_lb` \(6.0\) must be below `clip_cov_ub` \(5.0\)"):
        PPOConfig(policy_loss="clip_cov", clip_cov_lb=6.0)
    with pytest.raises(ValueError, match="clip_cov_ratio"):
        PPOConfig(policy_loss="clip_cov", clip_cov_ratio=1.5)
