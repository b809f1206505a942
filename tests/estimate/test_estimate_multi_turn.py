"""The estimate of a multi-turn run sizes the rollout and the update at the longest trajectory the
budgets allow (``model.multi_turn.max_total_tokens``), not at one answer's length (prompt +
``max_new_tokens``): on the tiny multi-turn config, the sampled rows are the budget long and the
rollout's KV cache holds the whole budget at its last decode step."""

from __future__ import annotations

import json

from lightning_mem.estimate.estimator import estimate
from lightning_mem.estimate.run import EstimateRun
from tests.helpers import REPO, TINY_MODEL

CONFIG = REPO / "configs" / "ppo" / "tiny_cpu_multi_turn.yaml"


class RecordedRollouts(EstimateRun):
    """The estimate's run, recording the shape of every rollout's sequences."""

    shapes: list[tuple[int, int]] = []

    def multi_turn_rollout(self, environment, config, **kwargs):
        stand_in = super().multi_turn_rollout(environment, config, **kwargs)
        rollout = stand_in.rollout

        def recorded(*args, **kw):
            exp = rollout(*args, **kw)
            RecordedRollouts.shapes.append(tuple(exp.input_ids.shape))
            return exp

        stand_in.rollout = recorded
        return stand_in


def test_the_estimate_samples_every_trajectory_to_its_token_budget():
    budget = 256  # one answer would be 64 prompt tokens + 6 new ones
    RecordedRollouts.shapes = []
    result = estimate(CONFIG, [f"--model.name_or_path={TINY_MODEL}", f"--model.multi_turn.max_total_tokens={budget}"],
                      run_class=RecordedRollouts)
    assert RecordedRollouts.shapes[-1] == (32, budget)  # the measured step (after the warm-up's short rows)
    config = json.loads((TINY_MODEL / "config.json").read_text())
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * 4  # K and V, fp32
    kv = {p.phase: p.device_breakdown_bytes.get("kv_cache", 0) for p in result.phases}["rollout"]
    # The last decode step reads every earlier token of all 32 rows (and appends one more).
    assert 32 * (budget - 1) * per_token <= kv < 32 * budget * per_token * 1.2


def test_a_separate_generator_is_estimated_at_the_token_budget():
    result = estimate(CONFIG, [f"--model.name_or_path={TINY_MODEL}", "--model.multi_turn.max_total_tokens=256",
                               "--model.rollout_engine.placement=separate"])
    generate = {p.phase: p for p in result.generator.phases}["generate"]
    assert generate.shape.startswith("32 x 256 tokens")
