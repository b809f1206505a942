"""A multi-turn trajectory's response mask has holes (the observation tokens between two turns):
every place of the PPO update that once read the mask as a prefix of its row holds for it.

Each test compares a holed batch with the same sampled tokens laid out without the holes (the
"compacted" batch), where the prefix arithmetic is the known answer: GAE and returns skip the
observation tokens (the value bootstraps across them); the score lands on the last sampled token;
the overlong filter reads that token; a micro-batch's columns reach the last sampled token; the
actor's log-probs and the critic's values are those of each token where it sits, padded and packed.
"""

from __future__ import annotations

import pytest
import torch

from lightning_mem.models import load_causal_lm
from lightning_mem.packed_attention import use_packed_sdpa
from lightning_mem.rl.advantages import discounted_returns
from lightning_mem.rl.algorithms import gae_advantages, last_token_index, rewards_with_kl_penalty
from lightning_mem.rl.critic import critic_values, load_value_model
from lightning_mem.rl.rollout import Experience, policy_forward, response_spans
from lightning_mem.rl.sample_filters import truncated
from tests.helpers import TINY_MODEL

#: Sampled (1) and observation (0) tokens after each prompt; trailing zeros are padding.
MASK = torch.tensor([
    [1, 1, 0, 0, 0, 1, 1, 1],  # two turns, a three-token observation between them
    [1, 1, 1, 0, 0, 0, 0, 0],  # one turn: a prefix
    [1, 0, 0, 1, 0, 0, 1, 0],  # three one-token turns
])


def compact(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's masked-in values moved to the front: the same actions without the holes."""
    out, prefix = torch.zeros_like(values), torch.zeros_like(mask)
    for i in range(mask.shape[0]):
        kept = values[i][mask[i].bool()]
        out[i, : len(kept)], prefix[i, : len(kept)] = kept, 1
    return out, prefix


def test_gae_bootstraps_across_observation_tokens():
    rewards, values = torch.randn(MASK.shape), torch.randn(MASK.shape)
    rewards[~MASK.bool()] = 7.0  # whatever sits at an observation token must not count
    advantages, returns = gae_advantages(rewards, values, MASK, gamma=0.9, lam=0.8)
    expected = gae_advantages(*compact(rewards, MASK)[:1], compact(values, MASK)[0], compact(rewards, MASK)[1],
                              gamma=0.9, lam=0.8)
    for got, want in zip((advantages, returns), expected):
        assert torch.allclose(compact(got, MASK)[0], want, atol=1e-6)
        assert (got[~MASK.bool()] == 0).all()


def test_discounted_returns_skip_observation_tokens():
    rewards = torch.randn(MASK.shape)
    rewards[~MASK.bool()] = 7.0
    got = discounted_returns(rewards, MASK, gamma=0.9)
    assert torch.allclose(compact(got, MASK)[0], discounted_returns(*compact(rewards, MASK), gamma=0.9), atol=1e-6)
    assert (got[~MASK.bool()] == 0).all()


def test_the_score_lands_on_the_last_sampled_token():
    assert last_token_index(MASK).tolist() == [7, 2, 6]
    rewards = rewards_with_kl_penalty(torch.tensor([1.0, 2.0, 3.0]), torch.zeros(MASK.shape), MASK, 0.1)
    assert rewards[0, 7] == 1.0 and rewards[1, 2] == 2.0 and rewards[2, 6] == 3.0 and rewards.sum() == 6.0
    assert last_token_index(torch.zeros(2, 3)).tolist() == [0, 0]


def test_the_overlong_filter_reads_the_last_sampled_token():
    ids = torch.full(MASK.shape, 9)
    ids[0, 7], ids[2, 6] = 1, 1  # rows 0 and 2 end with the end token; row 1 stops without it
    cut = truncated(ids, MASK, eos_token_ids=[1], max_new_tokens=3)
    assert cut.tolist() == [False, True, False]


def _holed_experience() -> Experience:
    g = torch.Generator().manual_seed(0)
    prompts = [3, 5, 2]
    n, r = MASK.shape
    spans = response_spans(MASK).tolist()
    assert spans == [8, 3, 7]
    width = max(p + s for p, s in zip(prompts, spans))
    ids, attention = torch.zeros(n, width, dtype=torch.long), torch.zeros(n, width, dtype=torch.long)
    response_ids = torch.zeros(n, r, dtype=torch.long)
    for i, (p, s) in enumerate(zip(prompts, spans)):
        ids[i, : p + s] = torch.randint(5, 300, (p + s,), generator=g)
        attention[i, : p + s] = 1
        response_ids[i, :s] = ids[i, p : p + s]
    return Experience(input_ids=ids, attention_mask=attention, prompt_lengths=torch.tensor(prompts),
                      response_ids=response_ids, response_mask=MASK.clone(), group_ids=torch.arange(n))


def test_a_micro_batch_keeps_the_columns_up_to_the_last_sampled_token():
    exp = _holed_experience()
    assert exp.sequence_lengths == [11, 8, 9]
    assert exp.host_lengths[1:] == ([8, 3, 7], [5, 3, 3]) and exp.contiguous_lengths is None
    for picked in ([2], torch.tensor([2])):  # from host lengths, and from the device
        mb = exp.select(picked)
        assert mb.response_mask.shape[1] == 7 and mb.response_mask.sum() == 3
    prefix = exp.select([1])
    assert prefix.contiguous_lengths == [3]  # a micro-batch without holes takes the host fast path


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    actor, critic = load_causal_lm(str(TINY_MODEL)), load_value_model(str(TINY_MODEL))
    torch.nn.init.normal_(critic.value_head.summary.weight, std=0.02)
    return actor, critic


@pytest.mark.parametrize("packed", [False, True])
def test_log_probs_and_values_are_each_tokens_where_it_sits(models, packed):
    actor, critic = models
    exp = _holed_experience()
    full = Experience(**{**exp.__dict__, "response_mask": (torch.arange(MASK.shape[1]) < response_spans(MASK)[:, None]).long()})
    exp.sequence_lengths  # read the host lengths: the holed batch must not take the prefix fast path
    if packed:
        use_packed_sdpa(actor) and use_packed_sdpa(critic)
    with torch.no_grad():
        holed = policy_forward(actor, exp, with_entropy=True, packed=packed)
        every = policy_forward(actor, full, with_entropy=True, packed=False)
        values, every_value = critic_values(critic, exp, packed=packed), critic_values(critic, full, packed=False)
    sampled = MASK.bool()
    for got, want in ((holed.logprobs, every.logprobs), (holed.entropy, every.entropy)):
        assert torch.allclose(got[sampled], want[sampled], atol=1e-5)
        assert (got[~sampled] == 0).all()  # the observation tokens are not scored
    assert torch.allclose(values[sampled], every_value[sampled], atol=1e-5)
