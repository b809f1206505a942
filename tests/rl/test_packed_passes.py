"""Packed RL passes (``model.ppo.packing``) compute what the padded ones compute (fp32, CPU, 1e-5).

- per sequence, the actor's log-probs, entropies and hidden states and the critic's values from one
  packed row equal those from the right-padded batch, and the packed forward really is one row with
  no attention mask;
- the gradient of the recipe's train loss on a packed micro-batch equals the padded one's (GAE with
  a separate critic and a KL penalty: actor and critic gradients);
- one PPO (GAE, critic, reference) and one GRPO iteration of the recipe's real fit, packed and
  padded, leave the same weights;
- the plan fills a packed budget with real tokens; bad combinations fail before any model loads.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything

import recipes.ppo as ppo
from lightning_mem.data import PromptDataModule
from lightning_mem.models import load_causal_lm
from lightning_mem.packed_attention import NAME, sequence_bounds, use_packed_sdpa
from lightning_mem.rl.config import GRPOConfig, KLConfig, PPOConfig
from lightning_mem.rl.critic import critic_values, load_value_model
from lightning_mem.rl.microbatch import PackedBudget, micro_batches
from lightning_mem.rl.rollout import Experience, GenerationConfig, policy_forward
from lightning_mem.settings import SettingError
from lightning_mem.step_io import StepIO
from recipes.rewards import ArithmeticReward
from tests.helpers import ARITH, TINY_MODEL

PROMPTS = [3, 7, 5, 9, 4, 6]  # prompt lengths differ, so each response starts at its own column
RESPONSES = [6, 1, 4, 2, 6, 3]  # one single-token response
R = max(RESPONSES)


def _experience() -> Experience:
    g = torch.Generator().manual_seed(0)
    n, width = len(PROMPTS), max(p + r for p, r in zip(PROMPTS, RESPONSES))
    ids = torch.zeros(n, width, dtype=torch.long)
    attention = torch.zeros(n, width, dtype=torch.long)
    response_ids = torch.zeros(n, R, dtype=torch.long)
    response_mask = torch.zeros(n, R, dtype=torch.long)
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES)):
        ids[i, : p + r] = torch.randint(3, 300, (p + r,), generator=g)
        attention[i, : p + r] = 1
        response_ids[i, :r] = ids[i, p : p + r]
        response_mask[i, :r] = 1
    return Experience(
        input_ids=ids, attention_mask=attention, prompt_lengths=torch.tensor(PROMPTS), response_ids=response_ids,
        response_mask=response_mask, group_ids=torch.arange(n) // 2, scores=torch.tensor([1.0, 0.0, 0.5, 0.5, 0.0, 1.0]),
    )


@pytest.fixture(scope="module", params=["sdpa", "packed_sdpa"])
def models(request):
    """The tiny actor and critic under ``sdpa`` (a packed row isolated by the block-diagonal mask)
    or switched to ``packed_sdpa`` (each sequence of the row alone), as the recipe switches them."""
    torch.manual_seed(0)
    actor = load_causal_lm(str(TINY_MODEL))
    critic = load_value_model(str(TINY_MODEL))
    # The head starts at zero (every value 0): a random one makes the values depend on the states.
    torch.nn.init.normal_(critic.value_head.summary.weight, std=0.02)
    if request.param == "packed_sdpa":
        assert use_packed_sdpa(actor) and use_packed_sdpa(critic)
    return actor, critic


def _one_row_without_mask(model: torch.nn.Module) -> list[tuple]:
    """What each forward of ``model`` was given: (input shape, attention mask given, position ids given)."""
    seen = []
    model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append((tuple(kwargs["input_ids"].shape), kwargs.get("attention_mask") is not None,
                                                  kwargs.get("position_ids") is not None)),
        with_kwargs=True,
    )
    return seen


def test_log_probs_entropies_and_values_packed_equal_padded(models):
    actor, critic = models
    exp = _experience()
    mask = exp.response_mask.bool()
    seen = _one_row_without_mask(actor)
    out = {}
    with torch.no_grad():
        for packed in (False, True):
            policy = policy_forward(actor, exp, with_entropy=True, with_hidden=True, chunk_size=4, packed=packed)
            out[packed] = (policy.logprobs, policy.entropy, policy.hidden, critic_values(critic, exp, packed=packed))
    tokens = sum(PROMPTS) + sum(RESPONSES)
    assert seen == [((len(PROMPTS), exp.input_ids.shape[1]), True, False), ((1, tokens), False, True)]
    for name, padded, packed in zip(("logprobs", "entropy", "hidden", "values"), out[False], out[True]):
        assert packed.shape == padded.shape, name
        torch.testing.assert_close(packed[mask], padded[mask], atol=1e-5, rtol=1e-5, msg=name)
    assert out[True][3][mask].std() > 0.1  # the values really vary from token to token
    # Isolation: a sequence's results do not move when another sequence of its row changes.
    other = _experience()
    other.input_ids[0, : PROMPTS[0]] = 5
    with torch.no_grad():
        moved = policy_forward(actor, other, packed=True).logprobs
    torch.testing.assert_close(moved[1:][mask[1:]], out[True][0][1:][mask[1:]], atol=1e-6, rtol=0)
    assert not torch.allclose(moved[0][mask[0]], out[True][0][0][mask[0]])


# -- the recipe's passes, with a stand-in trainer -----------------------------------------------------


class StandIn(ppo.PPOModule):
    """The recipe's score, advantage and loss code on given models, with a stand-in trainer."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.stand_in = SimpleNamespace(world_size=1, global_rank=0, strategy=SimpleNamespace(), callbacks=[])

    @property
    def trainer(self):  # noqa: D401  (the stand-in, not a Lightning Trainer)
        return self.stand_in


def _gae_module(models, packing: bool) -> StandIn:
    module = StandIn(
        name_or_path=str(TINY_MODEL), reward=ArithmeticReward(), advantage_estimator="gae",
        kl=KLConfig(coef=0.1, estimator="k3", in_reward=False), generation=GenerationConfig(max_new_tokens=R),
        ppo=PPOConfig(num_mini_batches=2, max_grad_norm=None, entropy_coef=0.01, packing=packing,
                      max_tokens_per_microbatch=24,
                      logprob_max_tokens_per_microbatch=30),
        export_dir=None,
    )
    module.actor, module.critic = models
    module.value_function.module = module.critic
    module.reference_policy.module = module.actor  # a frozen copy of the starting policy is the actor itself here
    return module


def test_train_micro_batch_gradient_packed_equals_padded(models):
    """Score pass (old and reference log-probs, values) in micro-batches, GAE, then the train loss
    of the whole batch as one micro-batch: the actor's and the critic's gradients, packed = padded."""
    grads, losses = {}, {}
    for packing in (False, True):
        module = _gae_module(models, packing)
        exp = _experience()
        module.logprobs_and_values(exp)
        # Off the policy and the reference a little, so the ratio, the clips and the KL term act.
        noise = torch.randn(exp.response_ids.shape, generator=torch.Generator().manual_seed(1))
        exp.old_logprobs = exp.old_logprobs + 0.05 * noise * exp.response_mask
        exp.ref_logprobs = exp.ref_logprobs - 0.1 * noise.abs() * exp.response_mask
        module.advantages(exp)
        for p in [*module.actor.parameters(), *module.critic.parameters()]:
            p.grad = None
        loss, _ = module.loss(exp)
        loss.backward()
        losses[packing] = loss.detach()
        grads[packing] = {name: p.grad.clone() for name, p in
                          [*module.actor.named_parameters(prefix="actor"), *module.critic.named_parameters(prefix="critic")]}
    torch.testing.assert_close(losses[True], losses[False], atol=1e-5, rtol=1e-5)
    for name, padded in grads[False].items():
        torch.testing.assert_close(grads[True][name], padded, atol=1e-5, rtol=1e-5, msg=name)
    assert sum(bool(g.abs().sum() > 0) for g in grads[False].values()) > len(grads[False]) // 2  # not a no-op


# -- one iteration of the real fit ----------------------------------------------------------------------


class PlanRecorder(StepIO, Callback):
    """The plain run's micro-batch plans, recorded: (budget, micro-batches) per pass."""

    def __init__(self) -> None:
        self.plans: list[tuple[object, list[list[int]]]] = []

    def micro_batches(self, lengths, max_tokens, *, agree_on_count=None):
        plan = super().micro_batches(lengths, max_tokens, agree_on_count=agree_on_count)
        self.plans.append((max_tokens, plan))
        return plan


class Snapshot(ppo.PPOModule):
    def on_fit_start(self):
        self.initial = {k: v.detach().clone() for k, v in self.actor.named_parameters()}
        super().on_fit_start()


def _fit(root, packing: bool, **overrides) -> tuple[ppo.PPOModule, PlanRecorder]:
    seed_everything(0)
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731  (weights move by the gradient itself)
    kwargs = dict(name_or_path=str(TINY_MODEL), reward=ArithmeticReward(), generation=GenerationConfig(max_new_tokens=6),
                  optimizer=sgd, critic_optimizer=sgd, export_dir=None)
    kwargs.update(overrides)
    kwargs["ppo"] = replace(kwargs["ppo"], packing=packing)
    module, recorder = Snapshot(**kwargs), PlanRecorder()
    data = PromptDataModule(str(ARITH / "prompts.jsonl"), tokenizer=str(TINY_MODEL), batch_size=4, max_prompt_length=64)
    trainer = Trainer(accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=1, default_root_dir=root,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[recorder])
    trainer.fit(module, data)
    return module, recorder


ITERATIONS = {
    # Two mini-batches (so the score pass runs), a reference and a separate critic; small budgets: several micro-batches.
    "ppo": dict(advantage_estimator="gae",
                ppo=PPOConfig(num_mini_batches=2, max_grad_norm=None, max_tokens_per_microbatch=30,
                              logprob_max_tokens_per_microbatch=40)),
    "grpo": dict(advantage_estimator="grpo", grpo=GRPOConfig(group_size=4), kl=KLConfig(coef=0.05, estimator="k3", in_reward=False),
                 ppo=PPOConfig(num_mini_batches=2, max_grad_norm=None, max_tokens_per_microbatch=64,
                               logprob_max_tokens_per_microbatch=96)),
}


@pytest.mark.parametrize("name", sorted(ITERATIONS))
def test_one_iteration_packed_leaves_the_weights_padded_leaves(tmp_path, name):
    runs = {packing: _fit(tmp_path / str(packing), packing, **ITERATIONS[name]) for packing in (False, True)}
    trained = {}
    for packing, (module, recorder) in runs.items():
        trained[packing] = {f"actor.{k}": v.detach() for k, v in module.actor.named_parameters()}
        if module.critic is not None:
            trained[packing].update({f"critic.{k}": v.detach() for k, v in module.critic.named_parameters()})
        # The plan counted real tokens packed, padded ones padded; the passes ran several micro-batches.
        budgets = {type(budget) for budget, _ in recorder.plans}
        assert budgets == ({PackedBudget} if packing else {int})
        models = [m for m in (module.actor, module.reference, module.critic and module.critic.backbone) if m is not None]
        assert {m.config._attn_implementation for m in models} == ({NAME} if packing else {"sdpa"})
        assert len(recorder.plans) == 3 and all(len(plan) > 1 for _, plan in recorder.plans)  # score + 2 mini-batches
    padded, _ = runs[False]
    assert (padded.critic is not None) == (name == "ppo")
    for key, weight in trained[False].items():
        torch.testing.assert_close(trained[True][key], weight, atol=1e-5, rtol=1e-5, msg=key)
    moved = [not torch.allclose(padded.initial[k], v, atol=1e-6) for k, v in padded.actor.named_parameters()]
    assert sum(moved) > len(moved) // 2  # the update was not a no-op


def test_packed_sdpa_cuts_packed_rows_only_and_leaves_the_rest_to_sdpa():
    q = torch.zeros(1, 2, 7, 4)
    restarting = torch.tensor([[0, 1, 2, 0, 1, 0, 1]])
    assert sequence_bounds(q, q, restarting) == [(0, 3), (3, 5), (5, 7)]
    assert sequence_bounds(q, q, torch.arange(7).unsqueeze(0)) is None  # one sequence
    assert sequence_bounds(q, torch.zeros(1, 2, 9, 4), restarting) is None  # a KV cache: generation
    assert sequence_bounds(torch.zeros(2, 2, 7, 4), torch.zeros(2, 2, 7, 4), restarting.expand(2, -1)) is None
    assert sequence_bounds(q, q, None) is None
    # Padded batches and generation are sdpa's, unchanged.
    torch.manual_seed(0)
    plain, switched = load_causal_lm(str(TINY_MODEL)), load_causal_lm(str(TINY_MODEL))
    switched.load_state_dict(plain.state_dict())
    assert use_packed_sdpa(switched) and not use_packed_sdpa(switched)  # once: it no longer runs sdpa
    exp = _experience()
    with torch.no_grad():
        padded = dict(input_ids=exp.input_ids, attention_mask=exp.attention_mask)
        assert torch.equal(plain(**padded).logits, switched(**padded).logits)
        prompt = dict(input_ids=exp.input_ids[:2, :3], attention_mask=exp.attention_mask[:2, :3], max_new_tokens=4,
                      do_sample=False, pad_token_id=0)
        assert torch.equal(plain.generate(**prompt), switched.generate(**prompt))


# -- the plan and the refusals ---------------------------------------------------------------------------


def test_a_packed_budget_counts_real_tokens():
    lengths = [40, 3, 35, 5, 20, 9, 30, 2]
    padded = micro_batches(lengths, 64)
    packed = micro_batches(lengths, PackedBudget(64))
    assert sorted(i for b in packed for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 64 for b in packed)
    assert len(packed) == 3 < len(padded)  # 144 tokens in 3 rows of <= 64; padded, 40 x 2 > 64 already splits
    split = micro_batches(lengths, PackedBudget(64), agree_on_count=lambda n: 5)  # another rank needed 5
    assert len(split) == 5 and sorted(i for b in split for i in b) == list(range(len(lengths)))
    with pytest.raises(ValueError, match="positive"):
        PackedBudget(0)


def test_an_attention_that_cannot_isolate_sequences_fails_before_any_model(monkeypatch):
    monkeypatch.setattr(ppo, "load_causal_lm", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(SettingError, match=r"`model.attn_implementation` \('paged_attention'\).*`model.ppo.packing: true`"):
        ppo.PPOModule(name_or_path=str(TINY_MODEL), reward=ArithmeticReward(), attn_implementation="paged_attention",
                      ppo=PPOConfig(packing=True))
    ppo.PPOModule(name_or_path=str(TINY_MODEL), reward=ArithmeticReward(), attn_implementation="paged_attention")


@pytest.mark.parametrize("split", [dict(tensor_parallel_size=2), dict(context_parallel_size=2)])
def test_packing_with_a_model_split_fails_before_any_model(split):
    module = StandIn(name_or_path=str(TINY_MODEL), reward=ArithmeticReward(), ppo=PPOConfig(packing=True))
    module.stand_in.strategy = SimpleNamespace(**split)
    key = next(iter(split))
    with pytest.raises(ValueError, match=rf"`model.ppo.packing: true` with `trainer.strategy.init_args.{key}: 2`"):
        module._check_packing_splits()
    module.ppo = replace(module.ppo, packing=False)
    module._check_packing_splits()  # unpacked, the split is fine
