"""Rollout plumbing: response masks, the right-padded re-layout, gathering response positions,
and logprobs that match what generation sampled from."""

import pytest
import torch

from lightning_mem.models import load_causal_lm
from lightning_mem.settings import settings_at
from lightning_mem.rl.rollout import (
    GenerationConfig,
    RolloutEngine,
    experience_from_generation,
    gather_response,
    policy_forward,
    response_mask_until_eos,
)
from tests.helpers import TINY_MODEL

EOS, PAD = 1, 0


def test_response_mask_keeps_the_first_eos_and_drops_what_follows():
    responses = torch.tensor([[5, 6, EOS, PAD, PAD], [7, EOS, 9, EOS, PAD], [5, 6, 7, 8, 9]])
    mask = response_mask_until_eos(responses, [EOS])
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]  # row 2: truncated, kept
    # Any of several end tokens stops a response.
    assert response_mask_until_eos(torch.tensor([[5, 3, 6]]), [EOS, 3]).tolist() == [[1, 1, 0]]


def test_experience_is_right_padded_prompt_then_response():
    # generate's output: prompts left-padded to width 3, then 3 response columns.
    prompt_ids = torch.tensor([[PAD, 10, 11], [12, 13, 14]])
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    sequences = torch.tensor([[PAD, 10, 11, 20, EOS, PAD], [12, 13, 14, 21, 22, 23]])
    exp = experience_from_generation(prompt_ids, prompt_mask, sequences, eos_token_ids=[EOS], pad_token_id=PAD)
    assert exp.input_ids.tolist() == [[10, 11, 20, EOS, PAD, PAD], [12, 13, 14, 21, 22, 23]]
    assert exp.attention_mask.tolist() == [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]]
    assert exp.prompt_lengths.tolist() == [2, 3]
    assert exp.response_ids.tolist() == [[20, EOS, PAD], [21, 22, 23]]
    assert exp.response_mask.tolist() == [[1, 1, 0], [1, 1, 1]]
    # select() trims the columns to the chosen samples' longest sequence and response.
    one = exp.select([0])
    assert one.input_ids.tolist() == [[10, 11, 20, EOS]]
    assert one.response_ids.tolist() == [[20, EOS]]


def test_gather_response_picks_the_position_before_each_token():
    # per_position[i, t] = 100 * i + t; sample 0 has prompt length 2, sample 1 prompt length 3.
    per_position = (torch.arange(6).unsqueeze(0) + 100 * torch.arange(2).unsqueeze(1)).float()
    picked = gather_response(per_position, torch.tensor([2, 3]), 2)
    assert picked.tolist() == [[1.0, 2.0], [102.0, 103.0]]
    # With logits kept from position 1 on (logits_to_keep), the offset shifts the index.
    assert gather_response(per_position[:, 1:], torch.tensor([2, 3]), 2, offset=1).tolist() == [[1.0, 2.0], [102.0, 103.0]]


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return load_causal_lm(str(TINY_MODEL)).eval()


def test_logprobs_match_the_generation_scores(tiny):
    """The training pass must see the distribution generation sampled from: compare policy_forward's
    logprobs with generate's own scores (same temperature) for every response token."""
    torch.manual_seed(1)
    prompt_ids = torch.tensor([[PAD, PAD, 10, 11, 12], [13, 14, 15, 16, 17]])
    prompt_mask = (prompt_ids != PAD).long()
    temperature = 0.7
    out = tiny.generate(
        input_ids=prompt_ids, attention_mask=prompt_mask, max_new_tokens=4, do_sample=True, temperature=temperature,
        top_k=0, top_p=1.0, eos_token_id=[EOS], pad_token_id=PAD, output_scores=True, return_dict_in_generate=True,
    )
    exp = experience_from_generation(prompt_ids, prompt_mask, out.sequences, eos_token_ids=[EOS], pad_token_id=PAD)
    scores = torch.stack(out.scores, dim=1).log_softmax(-1)  # [N, R, V], already divided by temperature
    expected = scores.gather(-1, out.sequences[:, 5:].unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        got = policy_forward(tiny, exp, temperature=temperature).logprobs
    mask = exp.response_mask.bool()
    torch.testing.assert_close(got[mask], expected[:, : got.shape[1]][mask], atol=1e-4, rtol=0)


def test_rollout_engine_static_cache_is_kept_until_freed(tiny):
    engine = RolloutEngine(GenerationConfig(max_new_tokens=3, kv_cache="static"), eos_token_ids=[EOS], pad_token_id=PAD)
    prompt_ids = torch.tensor([[10, 11, 12], [13, 14, 15]])
    exp = engine.generate(tiny, prompt_ids, torch.ones_like(prompt_ids))
    assert len(exp) == 2 and exp.response_mask.sum(dim=1).min() >= 1
    cache = engine.kv_cache
    assert cache is not None
    engine.generate(tiny, prompt_ids, torch.ones_like(prompt_ids))
    assert engine.kv_cache is cache  # same shape: reused, not reallocated
    assert engine.free_kv_cache() and engine.kv_cache is None
    dynamic = RolloutEngine(GenerationConfig(max_new_tokens=3), eos_token_ids=[EOS], pad_token_id=PAD)
    dynamic.generate(tiny, prompt_ids, torch.ones_like(prompt_ids))
    assert dynamic.kv_cache is None  # a dynamic cache lives and dies inside generate


def test_generation_config_names_the_bad_key():
    # Named as the PPO recipe names the section (the library names the field alone).
    with pytest.raises(ValueError, match=r"`model.generation.top_p` must be in \(0, 1\]"), settings_at("model.generation"):
        GenerationConfig(top_p=1.5)
    with pytest.raises(ValueError, match="`model.generation.max_new_tokens` must be positive"), settings_at("model.generation"):
        GenerationConfig(max_new_tokens=0)
