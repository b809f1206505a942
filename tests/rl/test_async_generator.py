"""The generator process's copy of the actor (:class:`~lightning_mem.rl.async_generator.GeneratorModel`)
without the link: its behaviour log-prob pass runs in the micro-batches of the trainer's no-grad
passes (``model.ppo.logprob_max_tokens_per_microbatch``, padded or packed), each within the budget,
and gives the log-probs of the whole-batch pass."""

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
    return GeneratorSpec(host="127.0.0.1", port=0, world_size=2, timeout_s=60, max_staleness=1,
                         name_or_path=str(TINY_MODEL), dtype="float32",
                         generation=GenerationConfig(max_new_tokens=12), eos_token_ids=[EOS], pad_token_id=PAD, **kw)


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
