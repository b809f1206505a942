"""A reward-model ensemble (``model.reward_model.name_or_path`` as a list): the aggregates by hand,
one member scoring as the plain reward model, the ensemble parked and returned by the memory plan
as one module, each bad setting refused in one line before any model loads, and two members
through the PPO CLI with their spread logged."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from torch import nn

import recipes.ppo as ppo
from lightning_mem.offload import module_residency
from lightning_mem.rl.config import RewardModelConfig
from lightning_mem.rl.memory_plan import PhaseMemory, PhaseMemoryPlan, PhasePlacement
from lightning_mem.rl.reward import (
    RewardModel,
    RewardModelEnsemble,
    aggregate_scores,
    load_reward_models,
    reward_spread,
)
from lightning_mem.settings import SettingError
from tests.helpers import REPO, TINY_MODEL, read_metric

CONFIG = str(REPO / "configs" / "ppo" / "tiny_cpu.yaml")


class Fixed(nn.Module):
    """A stub member: the same scores whatever it is asked."""

    def __init__(self, scores: list[float]) -> None:
        super().__init__()
        self.scores = torch.tensor(scores)

    def forward(self, prompt_messages, responses, *, max_tokens=None, agree_on_count=None):
        return self.scores.clone()


def _score(ensemble: RewardModelEnsemble) -> torch.Tensor:
    return ensemble([[{"role": "user", "content": "1+1="}]] * 2, ["2", "3"])


def test_aggregates_by_hand():
    members = [Fixed([1.0, 4.0]), Fixed([3.0, 0.0])]  # per response: mean 2 and 2, population std 1 and 2
    assert _score(RewardModelEnsemble(members)).tolist() == [2.0, 2.0]
    assert _score(RewardModelEnsemble(members, "min")).tolist() == [1.0, 0.0]
    assert _score(RewardModelEnsemble(members, "mean_minus_std")).tolist() == [1.0, 0.0]
    assert _score(RewardModelEnsemble(members, "mean_minus_std", 0.5)).tolist() == [1.5, 1.0]
    ensemble = RewardModelEnsemble(members)
    _score(ensemble)
    assert ensemble.last_std.tolist() == [1.0, 2.0]
    assert reward_spread(ensemble).item() == 3.0  # summed over samples; the metric divides by them
    assert reward_spread(RewardModelEnsemble(members[:1])) is None  # one member: no spread to log
    three = torch.tensor([[0.0, 1.0], [3.0, 1.0], [6.0, 1.0]])
    assert aggregate_scores(three, "mean_minus_std", 2.0).tolist() == pytest.approx([3.0 - 2 * 6.0 ** 0.5, 1.0])


def _classifier(folder, seed: int) -> str:
    """A tiny one-output classifier with its own random weights and the tiny tokenizer."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    shutil.copytree(TINY_MODEL, folder)
    config = AutoConfig.from_pretrained(TINY_MODEL, num_labels=1)
    torch.manual_seed(seed)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def classifiers(tmp_path_factory):
    root = tmp_path_factory.mktemp("reward_models")
    return [_classifier(root / name, seed) for name, seed in (("a", 1), ("b", 2))]


def test_one_member_list_scores_as_the_plain_path(classifiers):
    plain = load_reward_models(classifiers[0])
    assert type(plain) is RewardModel  # the module tree of existing configs and checkpoints
    ensemble = load_reward_models(classifiers[:1], aggregate="mean_minus_std")
    assert isinstance(ensemble, RewardModelEnsemble) and len(ensemble.members) == 1
    messages, responses = [[{"role": "user", "content": f"{i}+2="}] for i in range(3)], ["2", "13", "x"]
    torch.testing.assert_close(ensemble(messages, responses), plain(messages, responses), rtol=0, atol=0)


def test_the_memory_plan_parks_and_returns_the_ensemble_whole():
    ensemble = RewardModelEnsemble([nn.Linear(4, 1), nn.Linear(4, 1)])  # members with weights to move
    every = {name: p.numel() * p.element_size() for name, p in ensemble.named_parameters()}
    plan = PhaseMemoryPlan(rollout=PhasePlacement(reward_model="host"), train=PhasePlacement(reward_model="host"))
    memory = PhaseMemory(plan, reward_model=ensemble)
    for phase, where in (("train", "host"), ("score", "device"), ("rollout", "host")):
        memory.place(phase)
        ledger = module_residency(ensemble)
        # One move of the one module, every member's tensors in it (the ledger counts what moved).
        assert (ledger.location, ledger.tensors, ledger.bytes) == (where, 4, sum(every.values())), phase
        assert set(ledger.home) == set(every) == {f"members.{i}.{p}" for i in (0, 1) for p in ("weight", "bias")}


@pytest.fixture
def no_model_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad setting was reported")

    for name in ("load_causal_lm", "load_value_model", "load_reward_models"):
        monkeypatch.setattr(ppo, name, refuse)


def _cli(tmp_path, *extra):
    return ppo.main(["fit", "--config", CONFIG, f"--trainer.default_root_dir={tmp_path}", f"--model.name_or_path={TINY_MODEL}",
                     "--model.reward=null", *extra])


def test_bad_settings_are_one_line_each(tmp_path, no_model_load, classifiers):
    a, b = classifiers
    two = tmp_path / "two_labels"
    two.mkdir()
    config = json.loads((TINY_MODEL / "config.json").read_text())
    (two / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForSequenceClassification"],
                                                 "id2label": {"0": "bad", "1": "good"}}))
    cases = [
        (["--model.reward_model.name_or_path=[]"], r"^`model.reward_model.name_or_path` is an empty list"),
        ([f"--model.reward_model.name_or_path=[{a}, {a}]"], r"^`model.reward_model.name_or_path` lists .*/a twice"),
        ([f"--model.reward_model.name_or_path=[{a}, {b}]", "--model.reward_model.aggregate=max"],
         r"^`model.reward_model.aggregate` must be one of \('mean', 'min', 'mean_minus_std'\), got 'max'$"),
        ([f"--model.reward_model.name_or_path=[{a}, {b}]", "--model.reward_model.uncertainty_coef=2"],
         r"^`model.reward_model.uncertainty_coef` is a setting of `model.reward_model.aggregate: mean_minus_std`"),
        ([f"--model.reward_model.name_or_path=[{a}, {b}]", "--model.reward_model.aggregate=mean_minus_std",
          "--model.reward_model.uncertainty_coef=-1"], r"^`model.reward_model.uncertainty_coef` must be >= 0, got -1.0$"),
        ([f"--model.reward_model.name_or_path=[{a}, {two}]"],
         r"^`model.reward_model.name_or_path\[1\]`: .*two_labels is a LlamaForSequenceClassification with 2 outputs"),
        ([f"--model.reward_model.name_or_path=[{a}, {tmp_path / 'missing'}]"], r"^`model.reward_model.name_or_path\[1\]`"),
    ]
    for extra, message in cases:
        with pytest.raises(SettingError, match=message) as error:
            _cli(tmp_path, *extra)
        assert "\n" not in str(error.value)


def test_two_members_through_the_cli_log_their_spread(tmp_path, classifiers):
    a, b = classifiers
    cli = _cli(tmp_path, f"--model.reward_model.name_or_path=[{a}, {b}]", "--model.reward_model.aggregate=mean_minus_std",
         "--model.reward_model.uncertainty_coef=0.5", "--trainer.max_epochs=1", "--trainer.limit_train_batches=2",
         "--data.batch_size=4", "--checkpoint.every_n_train_steps=0", "--model.export_dir=null")
    spread, reward = read_metric(tmp_path, "reward_model_std"), read_metric(tmp_path, "reward_mean")
    assert len(spread) == 2 and set(spread) == set(reward)
    # Two differently initialised classifiers disagree on every sample: a spread above zero.
    assert all(value > 0 for value in spread.values())
    # The YAML's settings reached the ensemble: it scores mean - 0.5 std of its members' scores.
    ensemble = cli.model.reward_model
    assert isinstance(ensemble, RewardModelEnsemble) and cli.model.hparams.reward_model["name_or_path"] == [a, b]
    messages, responses = [[{"role": "user", "content": "3+4="}]] * 2, ["7", "12"]
    members = torch.stack([member(messages, responses) for member in ensemble.members])
    torch.testing.assert_close(ensemble(messages, responses), members.mean(0) - 0.5 * members.std(0, correction=0))
