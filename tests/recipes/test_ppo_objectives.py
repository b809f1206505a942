"""The PPO recipe's objectives (#29) through its own ``update`` and ``loss``: the same mini-batch in
1, 2 or 4 micro-batches, on 1 or 2 ranks (gloo), gives the same gradient to 1e-6 for every loss
aggregation mode, policy loss, filter and rollout correction; and the new metrics are counted.

The harness runs ``PPOModule.update`` on a fixed Experience with a stand-in trainer: its StepIO
(the hook the estimator uses too) makes exactly ``k`` micro-batches, ``_sum_over_ranks`` is a gloo
all-reduce, and the optimizer step records the gradient averaged over ranks (what DDP's all-reduce
gives). Sequence-mean modes must divide by the whole mini-batch's sequence count over both ranks,
so a micro-batch or a rank that normalised by its own count fails here.
"""

from __future__ import annotations

import socket
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

import recipes.ppo as ppo
from lightning_mem.models import load_causal_lm
from lightning_mem.rl.config import GRPOConfig, KLConfig, PPOConfig, RolloutCorrectionConfig
from lightning_mem.rl.loss_aggregation import LOSS_AGG_MODES
from lightning_mem.rl.rollout import Experience, GenerationConfig
from lightning_mem.step_io import StepIO
from recipes.rewards import ArithmeticReward
from tests.helpers import TINY_MODEL
from tests.recipes.test_ppo import _cli, no_model_load  # noqa: F401  (a fixture)

N, PROMPT, RESPONSE = 8, 5, 6  # 8 samples in 4 groups of 2; rank r holds groups 2r and 2r + 1

#: name -> (advantage_estimator, PPOConfig settings, rollout correction). Every aggregation mode,
#: every policy loss; the vanilla rows use decoupled and dual clipping; the filters and the
#: corrections each appear (TIS's weights, MIS's dropped tokens leaving the normaliser).
CASES = {
    **{mode: ("grpo", dict(loss_agg_mode=mode, clip_ratio_low=0.1, clip_ratio_high=0.15, clip_ratio_c=2.0,
                           filter_groups=True), RolloutCorrectionConfig(mode="tis", level="token", upper=1.05))
       for mode in LOSS_AGG_MODES},
    # ...and with DAPO's overlong filter: the three full-length responses (no end token) leave the loss.
    "overlong-filter": ("grpo", dict(loss_agg_mode="seq-mean-token-sum", overlong={"filter": True}),
                        RolloutCorrectionConfig()),
    "gspo": ("rloo", dict(policy_loss="gspo", loss_agg_mode="seq-mean-token-mean", clip_ratio_low=0.01,
                          clip_ratio_high=0.01), RolloutCorrectionConfig(mode="mis", level="sequence", upper=1.2, lower=0.8)),
    "cispo": ("reinforce_pp_baseline", dict(policy_loss="cispo", loss_agg_mode="seq-mean-token-sum-norm",
                                            clip_ratio_low=1.0, clip_ratio_high=0.1),
              RolloutCorrectionConfig(mode="mis", level="token", upper=1.1, lower=0.9)),
    # GMPO in its default (verl's) aggregation, unset here; pass@k advantages.
    "geo_mean": ("grpo_passk", dict(policy_loss="geo_mean", clip_ratio_low=0.05, clip_ratio_high=0.05, filter_groups=True),
                 RolloutCorrectionConfig(mode="tis", level="sequence", upper=1.05)),
    # ReMax under the vanilla surrogate (OPO's wiring: test_new_estimators_reach_the_update).
    "remax": ("remax", dict(loss_agg_mode="seq-mean-token-sum", clip_ratio=0.1), RolloutCorrectionConfig()),
}
# (Clip-Cov and KL-Cov are not here: as in verl, they choose their tokens among the micro-batch's,
# so the split changes the update; lightning_mem.rl.policy_losses.clip_cov_loss says so.)
SPLITS = (1, 2, 4)


class SplitInto(StepIO):
    """Exactly ``k`` micro-batches of consecutive samples (the plan is the StepIO's to make)."""

    def __init__(self, k: int) -> None:
        self.k = k

    def micro_batches(self, lengths, max_tokens, *, agree_on_count=None):
        return [chunk.tolist() for chunk in torch.tensor_split(torch.arange(len(lengths)), self.k)]


class GradientProbe(ppo.PPOModule):
    """The recipe's update, with a stand-in trainer, a gloo reduction and the step recording grads."""

    def __init__(self, *args, world_size: int = 1, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # No distributed_sampler_kwargs: every rank is a data-parallel replica (lightning_mem.ranks).
        self.stand_in = SimpleNamespace(world_size=world_size, global_rank=0, strategy=SimpleNamespace(),
                                        callbacks=[SplitInto(1)])
        self.grads: dict[str, torch.Tensor] = {}

    @property
    def trainer(self):  # noqa: D401  (the stand-in, not a Lightning Trainer)
        return self.stand_in

    def _sum_over_ranks(self, value):
        if self.stand_in.world_size == 1:
            return value
        value = value.clone()
        torch.distributed.all_reduce(value)
        return value

    def manual_backward(self, loss, *args, **kwargs):
        loss.backward()

    def _optimizer_step(self):
        for name, p in self.actor.named_parameters():
            grad = p.grad.clone()
            if self.stand_in.world_size > 1:  # DDP averages the ranks' gradients
                torch.distributed.all_reduce(grad)
                grad /= self.stand_in.world_size
            self.grads[name] = grad
            p.grad = None


def _experience() -> Experience:
    """8 samples with response lengths 1..6 (one single-token response), random tokens, old and
    engine log-probs off the actor's by a fixed noise (so the clips and corrections act); groups 0
    and 2 scored all alike (filtered where `filter_groups` is on)."""
    g = torch.Generator().manual_seed(0)
    lengths = [6, 1, 3, 6, 2, 5, 4, 6]
    ids = torch.randint(3, 200, (N, PROMPT + RESPONSE), generator=g)
    attention = torch.zeros(N, PROMPT + RESPONSE, dtype=torch.long)
    response_mask = torch.zeros(N, RESPONSE, dtype=torch.long)
    for i, n in enumerate(lengths):
        attention[i, : PROMPT + n] = 1
        response_mask[i, :n] = 1
    ids = ids * attention
    return Experience(
        input_ids=ids, attention_mask=attention, prompt_lengths=torch.full((N,), PROMPT),
        response_ids=ids[:, PROMPT:] * response_mask, response_mask=response_mask,
        group_ids=torch.arange(N) // 2, scores=torch.tensor([1.0, 1.0, 1.0, 0.0, 0.5, 0.5, 0.0, 1.0]),
        old_logprobs=0.3 * torch.randn(N, RESPONSE, generator=g),  # + the actor's (added in _grads)
        engine_logprobs=0.1 * torch.randn(N, RESPONSE, generator=g),
        baseline_scores=torch.tensor([0.5, 1.0, 0.0, 0.5, 1.0, 0.0, 0.5, 0.5]),  # ReMax's greedy answers
    )


def _module(case: str, world_size: int) -> GradientProbe:
    estimator, settings, correction = CASES[case]
    module = GradientProbe(
        name_or_path=str(TINY_MODEL), reward=ArithmeticReward(), advantage_estimator=estimator,
        grpo=GRPOConfig(group_size=2), kl=KLConfig(coef=0.0), generation=GenerationConfig(max_new_tokens=RESPONSE),
        ppo=PPOConfig(max_grad_norm=None, **settings), export_dir=None, world_size=world_size,
    )
    # The hf engine has no drift to correct (the recipe refuses the key with it); here the engine's
    # log-probs are given, so the correction is switched on after the checks.
    module.ppo = replace(module.ppo, rollout_correction=correction)
    torch.manual_seed(0)
    module.actor = load_causal_lm(str(TINY_MODEL))
    return module


def _grads(module: GradientProbe, exp: Experience, split: int) -> tuple[dict[str, torch.Tensor], dict]:
    exp = exp.select(list(range(len(exp))))  # a fresh copy: the stages fill it
    exp.sample_stats = {}
    from lightning_mem.rl.rollout import policy_forward

    with torch.no_grad():
        actor = policy_forward(module.actor, exp, chunk_size=None).logprobs
    exp.old_logprobs = (exp.old_logprobs + actor) * exp.response_mask
    exp.engine_logprobs = (exp.engine_logprobs + exp.old_logprobs) * exp.response_mask
    module.advantages(exp)
    module.stand_in.callbacks = [SplitInto(split)]
    totals = module.update(exp)
    return dict(module.grads), {k: float(v) for k, v in {**totals, **exp.sample_stats}.items()}


def _rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    try:
        exp = _experience().select(list(range(4 * rank, 4 * rank + 4)))
        results = {}
        for case in CASES:
            module = _module(case, world_size=2)
            results[case] = {split: _grads(module, exp, split)[0] for split in SPLITS}
        if rank == 0:
            torch.save(results, f"{out}/grads.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def single_rank():
    exp, out = _experience(), {}
    for case in CASES:
        module = _module(case, world_size=1)
        out[case] = {split: _grads(module, exp, split) for split in SPLITS}
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("ranks")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(port, str(out)), nprocs=2)  # one spawn for every case
    return torch.load(out / "grads.pt")


@pytest.mark.parametrize("case", list(CASES))
def test_gradient_is_the_same_for_any_split_and_rank_count(case, single_rank, two_ranks):
    reference, stats = single_rank[case][1]
    assert sum(float(g.abs().sum()) for g in reference.values()) > 0  # the update is not a no-op
    runs = {f"1 rank, {k} micro-batches": single_rank[case][k][0] for k in SPLITS}
    runs.update({f"2 ranks, {k} micro-batches": two_ranks[case][k] for k in SPLITS})
    for label, grads in runs.items():
        for name, g in reference.items():
            torch.testing.assert_close(grads[name], g, atol=1e-6, rtol=1e-5, msg=f"{case}, {label}: {name}")


def test_the_mini_batch_normaliser_matters():
    """The invariance is not trivially true: dividing each micro-batch by its own sequence count
    (what a per-micro-batch mean does) changes the gradient."""
    from lightning_mem.rl.loss_aggregation import aggregate

    loss, mask = torch.tensor([[1.0, 2.0], [3.0, 0.0], [5.0, 0.0]]), torch.tensor([[1, 1], [1, 0], [1, 0]])
    whole = aggregate(loss, mask, "seq-mean-token-sum")
    halves = (aggregate(loss[:1], mask[:1], "seq-mean-token-sum") + aggregate(loss[1:], mask[1:], "seq-mean-token-sum")) / 2
    assert whole.item() == pytest.approx(11 / 3) and halves.item() != pytest.approx(whole.item())


def test_clip_filter_and_correction_counts(single_rank):
    """The counts behind the new metrics, on the fixed batch (the same for every split)."""
    _, token_mean = single_rank["token-mean"][1]
    # groups 0 (1, 1) and 2 (0.5, 0.5) scored alike: 2 of 4 groups, 9 of 33 response tokens
    assert (token_mean["groups_filtered"], token_mean["groups"]) == (2.0, 4.0)
    assert token_mean["tokens"] == 33 - (6 + 1) - (2 + 5)
    assert token_mean["clipped_low"] + token_mean["clipped_high"] > 0
    assert token_mean["correction_affected"] > 0 and token_mean["mismatch_kl"] > 0
    for k in SPLITS:
        assert single_rank["token-mean"][k][1] == pytest.approx(token_mean)
    _, overlong = single_rank["overlong-filter"][1]
    assert overlong["truncated"] == 3 and overlong["tokens"] == 33 - 3 * 6  # rows 0, 3 and 7 reached 6 tokens
    _, mis = single_rank["cispo"][1]
    assert mis["tokens"] == 33 - mis["correction_affected"]  # MIS's dropped tokens left the loss


# -- the new estimators in the recipe's own stages ---------------------------------------------


def test_new_estimators_reach_the_update():
    """``advantages`` fills what the library's estimator gives, for OPO and pass@k GRPO."""
    from lightning_mem.rl.advantages import grpo_passk_advantages, opo_advantages

    exp = _experience()
    mask = exp.response_mask.float()
    for estimator, expected in (("opo", opo_advantages(exp.scores, exp.group_ids, mask)),
                                ("grpo_passk", grpo_passk_advantages(exp.scores, exp.group_ids, mask))):
        module = ppo.PPOModule(name_or_path=str(TINY_MODEL), reward=ArithmeticReward(), advantage_estimator=estimator,
                               grpo=GRPOConfig(group_size=2), kl=KLConfig(coef=0.0), export_dir=None)
        got = exp.select(list(range(N)))
        module.advantages(got)
        torch.testing.assert_close(got.advantages, expected)
        assert got.advantages.abs().sum() > 0


def test_remax_rollout_decodes_and_scores_one_greedy_answer_per_prompt():
    from lightning_mem.models import load_tokenizer
    from lightning_mem.rl.rollout import RolloutEngine

    module = _module("remax", world_size=1)
    module.generation = GenerationConfig(max_new_tokens=4, temperature=1.5)
    tok = module.tokenizer = load_tokenizer(str(TINY_MODEL))
    module.eos_token_ids = [tok.eos_token_id]
    module.rollout_engine = RolloutEngine(module.generation, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    rows = [{"prompt": "Compute 11 + 5.", "answer": "16"}, {"prompt": "What is 15 - 4?", "answer": "11"}]
    prompts = tok([r["prompt"] for r in rows], padding=True, padding_side="left", return_tensors="pt")
    torch.manual_seed(0)
    exp = module.rollout({"input_ids": prompts["input_ids"], "attention_mask": prompts["attention_mask"], "rows": rows})
    assert len(exp) == 2 and module.rollout_engine.config.do_sample  # one sample per prompt; sampling restored
    with torch.no_grad():
        greedy = module.actor.generate(**prompts, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id,
                                       eos_token_id=[tok.eos_token_id])
    expected = [tok.decode(ids, skip_special_tokens=True) for ids in greedy[:, prompts["input_ids"].shape[1]:]]
    assert exp.baseline_responses == expected
    module.score(exp)
    torch.testing.assert_close(exp.baseline_scores, ArithmeticReward()(exp.prompts, expected, rows).to(exp.scores.dtype))
    module.advantages(exp)  # no KL: the return at every token is the score
    first = exp.advantages[:, 0]
    torch.testing.assert_close(first, (exp.scores - exp.baseline_scores).float())


def test_new_objective_keys_are_named_from_the_cli(tmp_path, no_model_load):  # noqa: F811
    with pytest.raises(ValueError, match=r"^`model.ppo.clip_cov_ratio` is a setting of `model.ppo.policy_loss: clip_cov`"):
        _cli(tmp_path, "--model.advantage_estimator=grpo", "--model.ppo.clip_cov_ratio=0.01")
    with pytest.raises(ValueError, match=r"^`model.ppo.clip_cov_lb` \(5.0\) must be below `model.ppo.clip_cov_ub`"):
        _cli(tmp_path, "--model.ppo.policy_loss=clip_cov", "--model.ppo.clip_cov_lb=5", "--model.ppo.clip_cov_ub=2")
    with pytest.raises(ValueError, match=r"^`model.generation.do_sample: false` with `model.advantage_estimator: remax`"):
        _cli(tmp_path, "--model.advantage_estimator=remax", "--model.generation.do_sample=false")
    with pytest.raises(ValueError, match=r"^`model.ppo.policy_loss: geo_mean` with `model.advantage_estimator: gae`"):
        _cli(tmp_path, "--model.advantage_estimator=gae", "--model.ppo.policy_loss=geo_mean")


def test_the_estimate_measures_remaxs_greedy_generation(monkeypatch):
    """The estimator runs the recipe's rollout: in its measured step the greedy baseline's
    ``generate`` runs beside the sampled one, both through the estimator's generation shortcut
    (``model.generate`` replaced on the instance), so the rollout phase's figures include it."""
    from lightning_mem.estimate import estimate
    from lightning_mem.rl.rollout import RolloutEngine

    calls = []
    generate = RolloutEngine.generate

    def recording(self, model, *args, **kwargs):
        calls.append((self.config.do_sample, "generate" in vars(model)))
        return generate(self, model, *args, **kwargs)

    monkeypatch.setattr(RolloutEngine, "generate", recording)
    est = estimate("configs/ppo/tiny_cpu_grpo.yaml", ["--model.advantage_estimator=remax",
                                                      f"--model.name_or_path={TINY_MODEL}", "--data.batch_size=2"])
    assert (True, True) in calls and (False, True) in calls  # sampled and greedy, both measured
    assert len([c for c in calls if not c[0]]) == len([c for c in calls if c[0]])  # one greedy per sampled rollout
    rollout = next(p for p in est.phases if p.phase == "rollout")
    assert rollout.device_breakdown_bytes["kv_cache"] > 0  # the decode step's cache was measured
