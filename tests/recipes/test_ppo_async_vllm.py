"""Separate placement with the vLLM engine (``rollout_engine: {name: vllm, placement: separate}``): the
generator process runs vLLM, the recipe's in-process fit trains, on CPU over gloo.

Marked ``vllm`` (run in ``.venv-vllm``: ``make test-vllm``; skipped where vLLM is missing). As the
``hf`` engine's tests in ``test_ppo_async.py``: with a generator faster than the trainer no trained
sample is older than the bound and the versions the trainer records are those the generator sampled
under; with ``max_staleness: 0`` the behaviour log-probs (vLLM's own) equal the trainer's
recomputed old log-probs after every sync, at a learning rate that moves the weights visibly (a batch
sampled one version behind is off by a mismatch KL of 0.2-0.7 at this rate); and under ReMax the
greedy answers vLLM decodes are, at every step, the trainer's own greedy decode of its weights.
"""

from __future__ import annotations

import pytest

import recipes.ppo as ppo
from lightning_mem.rl.engine_config import RolloutEngineConfig
from tests.helpers import read_metric
from tests.recipes.test_ppo import fit
from tests.recipes.test_ppo_async import SlowTrainer, TracedModule, async_config, fit_with
from tests.rl.test_vllm_engine import LengthReward

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

VLLM_SEPARATE = RolloutEngineConfig(name="vllm", placement="separate", max_num_seqs=32)


def _moving(**kw):
    """Scores that vary between samples and large steps: every update moves the actor."""
    import torch

    return dict(reward=LengthReward(), optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2), **kw)


def test_vllm_generator_runs_ahead_to_the_bound_and_tags_the_versions_it_sampled_under(tmp_path):
    k, steps = 1, 4
    TracedModule.trace_path, TracedModule.delay_s = str(tmp_path / "trace.txt"), 0.0
    module, _ = fit_with(tmp_path, [SlowTrainer(1.0)], module_cls=TracedModule, steps=steps,
                         rollout_engine=VLLM_SEPARATE, async_rollout=async_config(k), **_moving())
    sampled = dict(tuple(int(x) for x in line.split()) for line in (tmp_path / "trace.txt").read_text().splitlines())
    assert [it for it, _ in module.trained] == list(range(steps))
    for iteration, versions in module.trained:
        assert set(versions) == {sampled[iteration]}  # the trainer's tag is the generator's version
        assert 0 <= iteration - sampled[iteration] <= k
    assert max(it - sampled[it] for it, _ in module.trained) == k  # it ran ahead as far as allowed
    hist = {j: read_metric(tmp_path, f"async/staleness_{j}") for j in range(k + 1)}
    assert all(sum(h.get(s, 0) for h in hist.values()) == 8 for s in range(steps))
    assert set(read_metric(tmp_path, "async/dropped").values()) == {0.0}
    # TIS against the generator's log-probs: ~0 for a batch sampled under the weights it trains
    # with, clearly above for one sampled a (large) update behind.
    kl = read_metric(tmp_path, "mismatch_kl")
    assert sorted(kl) == list(range(steps)), kl
    for iteration in range(steps):
        stale = iteration - sampled[iteration]
        assert (kl[iteration] > 1e-2) if stale else (abs(kl[iteration]) < 1e-4), (iteration, stale, kl)
    assert module.async_rollouts.client.process.exitcode == 0  # stopped, not killed


def test_vllm_behaviour_log_probs_equal_the_trainers_after_every_sync(tmp_path):
    """``max_staleness: 0``: each batch is sampled under the weights just synced, so vLLM's log-probs
    of its tokens equal the trainer's old log-probs of them (fp32 on CPU: different kernels, ~1e-6).
    A generator left with older weights, or with a prefix of an older version cached, would be off
    by far more after an update at this learning rate."""
    steps = 3
    fit(tmp_path, steps=steps, rollout_engine=VLLM_SEPARATE, async_rollout=async_config(0), **_moving())
    assert read_metric(tmp_path, "async/sampled_version") == {s: float(s) for s in range(steps)}
    kl, diff = read_metric(tmp_path, "mismatch_kl"), read_metric(tmp_path, "engine_logprob_abs_diff")
    assert sorted(kl) == sorted(diff) == list(range(steps))
    assert all(abs(v) < 1e-6 for v in kl.values()), kl  # measured: ~1e-13
    assert all(v < 1e-5 for v in diff.values()), diff  # measured: ~2e-7 (one sampled a version behind: 0.5-1.1)


class GreedyCheck(ppo.PPOModule):
    """Records, per step, the greedy answers the generator sent and the trainer's own greedy decode of
    the same prompts with the weights it holds (the ``hf`` engine's ``greedy_rollout``)."""

    def _separate_rollout(self, batch):
        import torch

        from lightning_mem.rl.rollout import RolloutEngine, greedy_rollout

        exp = super()._separate_rollout(batch)
        engine = RolloutEngine(self.generation, eos_token_ids=self.eos_token_ids, pad_token_id=self.tokenizer.pad_token_id)
        with torch.no_grad():
            ours = greedy_rollout(engine, self.actor, batch["input_ids"], batch["attention_mask"])
        self.greedy = getattr(self, "greedy", [])
        self.greedy.append((exp.baseline_responses, self._decode(ours)))
        return exp


def test_remax_with_a_vllm_generator_decodes_the_greedy_baseline_under_the_trained_weights(tmp_path):
    """``max_staleness: 0``: every step's greedy answers (vLLM, temperature 0) are the trainer's own
    greedy decode under the weights just synced, answer for answer, after updates that change them."""
    steps, batch = 3, 4
    module, _ = fit(tmp_path, module_cls=GreedyCheck, steps=steps, batch_size=batch, advantage_estimator="remax",
                    rollout_engine=VLLM_SEPARATE, async_rollout=async_config(0), **_moving())
    assert len(module.greedy) == steps
    for step, (theirs, ours) in enumerate(module.greedy):
        assert len(theirs) == batch and theirs == ours, (step, theirs, ours)
    assert len(read_metric(tmp_path, "baseline_reward_mean")) == steps
