"""The generator process's copy of the actor without the link.

- ``hf`` (:class:`~lightning_mem.rl.async_generator.GeneratorModel`): its behaviour log-prob pass
  runs in the micro-batches of the trainer's no-grad passes (``model.ppo.logprob_max_tokens_per_microbatch``,
  padded or packed), each within the budget, and gives the log-probs of the whole-batch pass; the
  greedy answers it adds when asked (ReMax) are ``greedy_rollout``'s on the same weights.
- ``vllm`` (:class:`~lightning_mem.rl.async_generator.VLLMGeneratorModel`, marked ``vllm``): each
  version, streamed in the weight sync's messages, is loaded in place, its log-probs are then the
  new weights', and no prefix cached under an old version serves a new one (the same run without
  the reset does: the test can fail).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightning_mem.rl.async_generator import GeneratorModel, GeneratorSpec
from lightning_mem.rl.microbatch import micro_batches
from lightning_mem.rl.rollout import GenerationConfig, policy_forward
from tests.helpers import ARITH, TINY_MODEL

EOS, PAD = 1, 0


def spec(**kw) -> GeneratorSpec:
    made = GeneratorSpec(host="127.0.0.1", port=0, world_size=2, timeout_s=60, max_staleness=1,
                         name_or_path=str(TINY_MODEL), dtype="float32",
                         generation=GenerationConfig(max_new_tokens=12), eos_token_ids=[EOS], pad_token_id=PAD)
    return dataclasses.replace(made, **kw)


def prompts(n: int):
    from lightning_mem.data import PromptDataModule

    data = PromptDataModule(str(ARITH / "prompts.jsonl"), tokenizer=str(TINY_MODEL), batch_size=n, max_prompt_length=64)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    return batch["input_ids"], batch["attention_mask"]


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_behaviour_logprobs_in_micro_batches_equal_the_whole_batch_pass(packing):
    budget = 100  # 16 samples of about 30 tokens: several micro-batches
    planned = []

    def plan(lengths, max_tokens):
        batches = micro_batches(lengths, max_tokens)
        planned.append((list(lengths), max_tokens, batches))
        return batches

    torch.manual_seed(0)
    split = GeneratorModel(spec(logprob_max_tokens=budget, packing=packing), plan=plan)
    whole = GeneratorModel(spec(), model=split.model)  # the same weights, one pass over the batch
    ids, mask = (t.repeat_interleave(2, dim=0) for t in prompts(8))  # a group of 2 per prompt, as the trainer sends
    torch.manual_seed(1)
    ours = split.sample(ids, mask, group_size=2)
    torch.manual_seed(1)
    theirs = whole.sample(ids, mask, group_size=2)
    for a, b in zip(ours[:5], theirs[:5]):  # the same samples (the same draws)
        assert torch.equal(a, b)
    response_mask = ours[4].bool()
    assert response_mask.sum() > 0
    torch.testing.assert_close(ours[5][response_mask], theirs[5][response_mask], atol=1e-5, rtol=0)
    assert torch.equal(ours[5][~response_mask], torch.zeros_like(ours[5][~response_mask]))

    (lengths, max_tokens, batches), = planned
    assert len(batches) >= 3 and sorted(i for b in batches for i in b) == list(range(16))
    if packing:  # a packed row's real tokens
        assert max_tokens.tokens == budget and all(sum(lengths[i] for i in b) <= budget for b in batches)
    else:  # padded: rows x the longest
        assert max_tokens == budget and all(len(b) * max(lengths[i] for i in b) <= budget for b in batches)


def test_the_whole_batch_pass_is_the_plain_policy_forward():
    """Without a budget the pass is one micro-batch: the whole-batch scoring the generator ran before."""
    torch.manual_seed(0)
    gen = GeneratorModel(spec())
    ids, mask = prompts(4)
    exp = gen.engine.generate(gen.model, ids, mask)
    with torch.no_grad():
        plain = policy_forward(gen.model, exp, chunk_size=gen.spec.logits_chunk_size).logprobs.float()
    assert torch.equal(gen.behaviour_logprobs(exp), plain * exp.response_mask)


def test_the_greedy_answers_are_greedy_rollouts_on_the_same_weights_beside_unchanged_samples():
    """ReMax: with ``greedy`` the generator's batch carries, after its six sample tensors, one greedy
    answer per row (response ids and lengths), token for token those of ``greedy_rollout`` on the
    same weights; the samples are those drawn without it, and sampling stays on afterwards."""
    from lightning_mem.rl.rollout import RolloutEngine, greedy_rollout

    gen = GeneratorModel(spec())
    ids, mask = prompts(4)
    torch.manual_seed(3)
    plain = gen.sample(ids, mask, group_size=1)
    torch.manual_seed(3)
    ours = gen.sample(ids, mask, group_size=1, greedy=True)
    assert len(plain) == 6 and len(ours) == 8
    for a, b in zip(ours[:6], plain):
        assert torch.equal(a, b)
    assert gen.engine.config.do_sample  # the greedy call switched it off for itself only
    engine = RolloutEngine(gen.spec.generation, eos_token_ids=[EOS], pad_token_id=PAD)
    expected = greedy_rollout(engine, gen.model, ids, mask)
    assert torch.equal(ours[6], expected.response_ids)
    assert torch.equal(ours[7], expected.response_lengths)


def test_the_budget_reaches_the_generator_from_the_recipes_ppo_settings():
    """The recipe's spec carries ``model.ppo``'s no-grad budget and packing (``logprob_budget`` falls
    back to the training budget), so the generator's peak follows the trainer's score phase's knob."""
    from lightning_mem.rl.config import PPOConfig

    for ppo, expected in [(PPOConfig(max_tokens_per_microbatch=512, logprob_max_tokens_per_microbatch=2048), 2048),
                          (PPOConfig(max_tokens_per_microbatch=512), 512), (PPOConfig(), None)]:
        made = _recipe_spec(ppo)
        assert (made.logprob_max_tokens, made.packing) == (expected, False)
    assert _recipe_spec(PPOConfig(max_tokens_per_microbatch=512, packing=True)).packing is True


def _recipe_spec(ppo) -> GeneratorSpec:
    from types import SimpleNamespace

    import recipes.ppo as recipe
    from recipes.rewards import ArithmeticReward

    module = recipe.PPOModule(name_or_path=str(TINY_MODEL), reward=ArithmeticReward(), ppo=ppo,
                              attn_implementation="sdpa" if ppo.packing else None)
    module.tokenizer, module.eos_token_ids = SimpleNamespace(pad_token_id=PAD), [EOS]
    module.sampling_rng = SimpleNamespace(cpu=torch.get_rng_state())
    module._generator_dtype = lambda: torch.float32
    strategy = SimpleNamespace(root_device=torch.device("cpu"))
    trainer = SimpleNamespace(strategy=strategy, world_size=1, num_devices=1)
    with _attached(module, trainer):
        return dataclasses.replace(module.generator_spec())


class _attached:
    """A module's ``trainer`` for one call, without a fit."""

    def __init__(self, module, trainer):
        self.module, self.trainer = module, trainer

    def __enter__(self):
        self.module._trainer = self.trainer

    def __exit__(self, *exc):
        self.module._trainer = None


# -- vLLM as the generator's copy ------------------------------------------------------------------


def _messages(actor, bucket_bytes=1 << 20):
    """Version messages as the trainer sends them (1 MiB buckets: a layer's parts in several)."""
    from lightning_mem.rl.async_client import weight_messages

    yield from weight_messages(actor, bucket_bytes=bucket_bytes, dtype=torch.float32)


def _mismatch(actor, samples):
    from lightning_mem.rl.engines import logprob_mismatch
    from lightning_mem.rl.rollout import Experience

    ids, attn, prompt_lengths, responses, response_mask, behaviour = samples
    exp = Experience(input_ids=ids, attention_mask=attn, prompt_lengths=prompt_lengths, response_ids=responses,
                     response_mask=response_mask, group_ids=torch.arange(len(ids)))
    with torch.no_grad():
        theirs = policy_forward(actor, exp).logprobs
    return float(logprob_mismatch(behaviour, theirs, response_mask))


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_vllm_generator_loads_each_version_and_no_prefix_cached_under_an_old_one_serves_it(monkeypatch):
    from lightning_mem.models import load_causal_lm
    from lightning_mem.rl.async_generator import VLLMGeneratorModel, generator_model
    from lightning_mem.rl.engine_config import RolloutEngineConfig
    from lightning_mem.rl.vllm_engine import VLLMRolloutEngine

    gen = generator_model(spec(engine=RolloutEngineConfig(name="vllm", max_num_seqs=32, placement="separate"),
                               generation=GenerationConfig(max_new_tokens=8)))
    assert isinstance(gen, VLLMGeneratorModel) and gen.engine.prefix_caching
    try:
        actors = []
        for seed in (0, 1):  # two versions: different weights
            torch.manual_seed(seed)
            actors.append(load_causal_lm(str(TINY_MODEL), dtype="float32").eval())
        # 4 prompts of 200 tokens (a full 128-token KV block each, which vLLM caches), 4 copies each.
        torch.manual_seed(2)
        ids = torch.randint(2, 307, (4, 200)).repeat_interleave(4, dim=0)
        mask = torch.ones_like(ids)

        def version(actor):
            gen.load_weights(_messages(actor))
            return _mismatch(actor, gen.sample(ids, mask, group_size=4))

        # Each version's log-probs are its weights' (vLLM's own, of the tokens it sampled), the second
        # sampled over prompts whose KV the first left in the prefix cache.
        assert version(actors[0]) < 1e-4
        assert version(actors[1]) < 1e-4
        assert gen.engine.weight_loads == 2  # one prefix-cache reset per load

        # The control: without the reset the cached prompts' KV of version 1 serve version 0's tokens.
        monkeypatch.setattr(VLLMRolloutEngine, "_reset_prefix_cache", lambda self: None)
        assert version(actors[0]) > 1e-2
    finally:
        gen.engine.close()


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_vllms_greedy_answers_are_greedy_rollouts_of_the_same_weights():
    """ReMax with a vLLM generator: its greedy answers (temperature 0), after a version is loaded,
    are token for token the ``hf`` engine's ``greedy_rollout`` on the actor that sent it; its samples
    are not greedy (the request's own sampling parameters)."""
    from lightning_mem.models import load_causal_lm
    from lightning_mem.rl.async_generator import generator_model
    from lightning_mem.rl.engine_config import RolloutEngineConfig
    from lightning_mem.rl.rollout import RolloutEngine, greedy_rollout

    gen = generator_model(spec(engine=RolloutEngineConfig(name="vllm", max_num_seqs=32, placement="separate")))
    try:
        torch.manual_seed(0)
        actor = load_causal_lm(str(TINY_MODEL), dtype="float32").eval()
        gen.load_weights(_messages(actor))
        ids, mask = prompts(8)
        ours = gen.sample(ids, mask, group_size=1, greedy=True)
        assert len(ours) == 8 and gen.engine.config.do_sample
        expected = greedy_rollout(RolloutEngine(gen.spec.generation, eos_token_ids=[EOS], pad_token_id=PAD), actor, ids, mask)
        assert torch.equal(ours[7], expected.response_lengths)
        assert torch.equal(ours[6], expected.response_ids)
        assert not torch.equal(ours[3], ours[6])  # the samples are not the greedy answers
    finally:
        gen.engine.close()
