"""The rollout samples exactly the distribution PPO's log-prob pass scores, whatever sampling
settings the checkpoint's ``generation_config.json`` carries.

The tiny model is saved with Qwen2.5-Instruct's sampling settings and more (a repetition penalty, a
no-repeat n-gram size, a suppressed token, min new tokens, top-k/top-p, temperature). Each engine
then samples many one- and two-token rollouts, and a chi-square test compares the sampled token
frequencies with the softmax that :func:`~lightning_mem.rl.rollout.policy_forward` scores. Any
checkpoint setting that leaked into the rollout (every one of them changes these tokens' odds)
makes the test fail: on the code before the fix, both `hf` tests failed with p = 0.0 (float64).
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter

import pytest
import torch

from lightning_mem.models import load_causal_lm
from lightning_mem.rl import sampling
from lightning_mem.rl.rollout import GenerationConfig, RolloutEngine, policy_forward
from lightning_mem.settings import settings_at
from tests.helpers import TINY_MODEL

EOS, PAD = 1, 0
PROMPT = [10, 11, 12, 13, 14]
#: Sampling settings in the Qwen2.5-Instruct checkpoints' generation_config.json, and more that a
#: checkpoint may carry; `suppress_tokens` and `begin_suppress_tokens` are filled in per model.
CHECKPOINT_SAMPLING = dict(
    do_sample=True, repetition_penalty=1.1, temperature=0.7, top_p=0.8, top_k=20,
    no_repeat_ngram_size=1, min_new_tokens=2, typical_p=0.9, min_p=0.05,
)
#: The threshold: a correct sampler fails it with probability 1e-3 per test, and the seeds are fixed.
P_MIN = 1e-3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny model with peaked next-token odds (scaled output layer, so that a changed setting
    moves them enough to see), saved with a generation_config.json of its own."""
    torch.manual_seed(0)
    model = load_causal_lm(str(TINY_MODEL))
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)
        probs = torch.softmax(model(torch.tensor([PROMPT])).logits[0, -1], -1)
    top = probs.argsort(descending=True).tolist()
    folder = tmp_path_factory.mktemp("qwen_like")
    model.save_pretrained(folder)
    settings = {**CHECKPOINT_SAMPLING, "suppress_tokens": [top[0]], "begin_suppress_tokens": [top[1]],
                "eos_token_id": EOS, "pad_token_id": PAD}
    (folder / "generation_config.json").write_text(json.dumps(settings))
    return folder


@pytest.fixture(scope="module")
def actor(checkpoint):
    model = load_causal_lm(str(checkpoint)).eval()
    assert model.generation_config.repetition_penalty == 1.1  # the folder's settings reached the model
    return model


def chi_square_p(observed: Counter, expected: dict[int, float], n: int) -> float:
    """p-value of ``observed`` counts (``n`` draws) against probabilities ``expected``; bins with an
    expected count under 5, and every token never drawn, are pooled into one."""
    obs, exp = [], []
    for token, p in expected.items():
        if p * n >= 5:
            obs.append(observed[token])
            exp.append(p * n)
    obs.append(n - sum(obs))
    exp.append(n - sum(exp))
    obs_t, exp_t = torch.tensor(obs, dtype=torch.float64), torch.tensor(exp, dtype=torch.float64)
    stat = ((obs_t - exp_t) ** 2 / exp_t.clamp_min(1e-12)).sum()
    dof = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def sample(engine, actor, rows: int, batch: int = 4000):
    """``rows`` rollouts of the same prompt; returns the experience batches and their scored log-probs."""
    out = []
    for start in range(0, rows, batch):
        n = min(batch, rows - start)
        ids = torch.tensor([PROMPT] * n)
        exp = engine.generate(actor, ids, torch.ones_like(ids))
        with torch.no_grad():
            logprobs = policy_forward(actor, exp, temperature=engine.config.temperature).logprobs
        out.append((exp, logprobs))
    return out


def token_odds(batches, column: int, given_first: int | None = None) -> tuple[Counter, dict[int, float], int]:
    """Counts of the tokens sampled at ``column`` and the scored probability of each (for column 1,
    among rollouts whose first token is ``given_first``: one context, one distribution)."""
    counts: Counter = Counter()
    probs: dict[int, float] = {}
    for exp, logprobs in batches:
        keep = exp.response_mask[:, column].bool()
        if given_first is not None:
            keep &= exp.response_ids[:, 0] == given_first
        for token, lp in zip(exp.response_ids[keep, column].tolist(), logprobs[keep, column].tolist()):
            counts[token] += 1
            old = probs.setdefault(token, float(torch.tensor(lp).exp()))
            assert abs(old - float(torch.tensor(lp).exp())) < 1e-4  # one context: one probability per token
    return counts, probs, sum(counts.values())


#: The engine's own settings, one entry per rollout path (the static-cache path joins here).
ENGINE_SETTINGS = [
    pytest.param(dict(kv_cache="dynamic"), id="dynamic"),
    pytest.param(dict(kv_cache="static"), id="static"),
]


@pytest.mark.parametrize("settings", ENGINE_SETTINGS)
def test_one_token_rollouts_sample_the_scored_softmax(actor, settings):
    torch.manual_seed(1234)
    engine = RolloutEngine(GenerationConfig(max_new_tokens=1, temperature=0.7, **settings), eos_token_ids=[EOS], pad_token_id=PAD)
    counts, probs, n = token_odds(sample(engine, actor, 4000), 0)
    assert len(counts) >= 5  # several tokens carry mass: the test can see a changed distribution
    assert chi_square_p(counts, probs, n) > P_MIN, counts.most_common(8)


@pytest.mark.parametrize("settings", ENGINE_SETTINGS)
def test_second_tokens_of_two_token_rollouts_sample_the_scored_softmax(actor, settings):
    # A repetition penalty and a no-repeat n-gram act on the second token through the first one.
    torch.manual_seed(4321)
    engine = RolloutEngine(GenerationConfig(max_new_tokens=2, temperature=0.7, **settings), eos_token_ids=[EOS], pad_token_id=PAD)
    batches = sample(engine, actor, 8000)
    first, _, _ = token_odds(batches, 0)
    commonest = first.most_common(1)[0][0]
    counts, probs, n = token_odds(batches, 1, given_first=commonest)
    assert n >= 1500 and len(counts) >= 5
    assert chi_square_p(counts, probs, n) > P_MIN, counts.most_common(8)


def processors_built(actor, engine, monkeypatch) -> list[str]:
    """The logits processors ``generate`` builds for one call of ``engine``, by class name."""
    built: list = []
    original = actor._get_logits_processor

    def recording(*args, **kwargs):
        processors = original(*args, **kwargs)
        built.extend(processors)
        return processors

    monkeypatch.setattr(actor, "_get_logits_processor", recording)
    ids = torch.tensor([PROMPT] * 2)
    engine.generate(actor, ids, torch.ones_like(ids))
    return [type(p).__name__ for p in built]


def test_generate_builds_only_the_temperature_processor_and_says_what_it_ignores(actor, monkeypatch):
    monkeypatch.setattr(sampling, "_said", set())
    sampled = RolloutEngine(GenerationConfig(max_new_tokens=2, temperature=0.7), eos_token_ids=[EOS], pad_token_id=PAD)
    with pytest.warns(UserWarning, match="the checkpoint's sampling settings are not used") as caught:
        assert processors_built(actor, sampled, monkeypatch) == ["TemperatureLogitsWarper"]
        processors_built(actor, sampled, monkeypatch)  # a second rollout says nothing more
    said = [str(w.message) for w in caught if "sampling settings" in str(w.message)]
    assert len(said) == 1 and "\n" not in said[0]
    # Named: every setting the rollout does not use. Not named: temperature (ours is the same 0.7),
    # do_sample (the same), the token ids.
    for named in ("repetition_penalty=1.1", "top_k=20", "top_p=0.8", "no_repeat_ngram_size=1", "min_new_tokens=2",
                  "typical_p=0.9", "min_p=0.05", "suppress_tokens=[", "begin_suppress_tokens=["):
        assert named in said[0], said[0]
    for unnamed in ("temperature", "do_sample", "eos_token_id", "pad_token_id"):
        assert unnamed not in said[0].split(": ", 1)[1], said[0]
    # The model keeps its own settings outside the rollout (an export writes them back as they were).
    assert actor.generation_config.repetition_penalty == 1.1
    greedy = RolloutEngine(GenerationConfig(max_new_tokens=2, do_sample=False), eos_token_ids=[EOS], pad_token_id=PAD)
    assert processors_built(actor, greedy, monkeypatch) == []


@pytest.mark.parametrize(("key", "value", "rule"), [("top_p", 0.8, "must be 1.0"), ("top_k", 20, "must be 0")])
def test_a_cut_the_log_probs_cannot_model_is_refused_naming_the_key(key, value, rule):
    with pytest.raises(ValueError, match=rf"^`model.generation.{key}` {rule}, got {value}: the log-prob pass scores"
                                         r" the full softmax at `model.generation.temperature`"), settings_at("model.generation"):
        GenerationConfig(**{key: value})


@pytest.mark.vllm
@pytest.mark.timeout(1800)
def test_vllm_rollouts_sample_the_scored_softmax(checkpoint, actor, monkeypatch):
    """The same two tests for the vLLM engine, started on the same folder (vLLM reads its
    generation_config.json unless told not to) with the actor's weights synced in."""
    from lightning_mem.rl.engines import RolloutEngineConfig
    from lightning_mem.rl.vllm_engine import VLLMRolloutEngine

    monkeypatch.setattr(sampling, "_said", set())
    engine = VLLMRolloutEngine(GenerationConfig(max_new_tokens=1, temperature=0.7), RolloutEngineConfig(name="vllm", max_num_seqs=256),
                               model_path=str(checkpoint), eos_token_ids=[EOS], pad_token_id=PAD)
    try:
        with pytest.warns(UserWarning, match=r"sampling settings are not used.*repetition_penalty=1\.1"):
            engine.start()
        engine.sync_weights(actor)
        torch.manual_seed(1234)  # the engine draws each request's seed from torch's generator
        counts, probs, n = token_odds(sample(engine, actor, 4000), 0)
        assert len(counts) >= 5 and chi_square_p(counts, probs, n) > P_MIN, counts.most_common(8)
        engine.config = GenerationConfig(max_new_tokens=2, temperature=0.7)
        batches = sample(engine, actor, 8000)
        commonest = token_odds(batches, 0)[0].most_common(1)[0][0]
        counts, probs, n = token_odds(batches, 1, given_first=commonest)
        assert n >= 1500 and len(counts) >= 5
        assert chi_square_p(counts, probs, n) > P_MIN, counts.most_common(8)
    finally:
        engine.close()
