"""Picking the rollout engine, its logprob diagnostic, and the memory plan's engine residency order;
all without vLLM (its own tests: test_vllm_engine.py; its settings: test_engine_config.py; the
weights a sync hands over: test_weight_sync.py)."""

from __future__ import annotations

import pytest
import torch

from lightning_mem.rl.engines import RolloutEngineConfig, build_rollout_engine, logprob_mismatch
from lightning_mem.rl.memory_plan import PhaseMemory, PhaseMemoryPlan
from lightning_mem.rl.rollout import GenerationConfig, RolloutEngine
from tests.helpers import TINY_MODEL


def test_hf_engine_is_the_default():
    engine = build_rollout_engine(RolloutEngineConfig(), GenerationConfig(), model_path=str(TINY_MODEL), eos_token_ids=[1], pad_token_id=0)
    assert type(engine) is RolloutEngine and not engine.needs_weight_sync


def test_logprob_mismatch_is_the_masked_mean_absolute_difference():
    engine = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, 0.0, 0.0]])
    trainer = torch.tensor([[-1.5, -1.0, 0.0], [-0.5, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert float(logprob_mismatch(engine, trainer, mask)) == pytest.approx((0.5 + 1.0 + 0.0) / 3)


class RecordingEngine:
    """An engine with weights of its own, recording what the plan asks of it (and the optimizer
    state's location when it is asked)."""

    name = "recording"
    needs_weight_sync = True

    def __init__(self, optimizer, level=1):
        self.calls, self.optimizer, self.level, self.sleeping = [], optimizer, level, 0

    def _where(self):
        from lightning_mem.offload import optimizer_state_location

        return optimizer_state_location(self.optimizer)

    @property
    def weights_lost_in_sleep(self):
        return self.sleeping == 2

    @property
    def state(self):
        return f"asleep(level {self.sleeping})" if self.sleeping else "awake"

    def wake(self, tags):
        self.calls.append((f"wake {tags[0]}", self._where()))
        if "kv_cache" in tags:
            self.sleeping = 0

    def sync_weights(self, actor):
        self.calls.append(("sync", self._where()))
        return 0

    def sleep(self, level=None):
        self.calls.append(("sleep", self._where()))
        self.sleeping = self.level


@pytest.mark.parametrize("level", [1, 2])
def test_plan_wakes_the_engine_after_the_offload_syncs_then_wakes_the_kv_cache(level):
    from lightning_mem.rl.memory_plan import PhasePlacement
    from tests.rl.test_memory_plan import trained_optimizer

    actor = torch.nn.Linear(4, 4)
    optimizer = trained_optimizer(actor)
    engine = RecordingEngine(optimizer, level)
    plan = PhaseMemoryPlan(rollout=PhasePlacement(actor_optimizer="host"), score=PhasePlacement(actor_optimizer="host"))
    memory = PhaseMemory(plan, actor_optimizer=optimizer, rollout_engine=engine, actor=actor)
    for _ in range(2):
        for phase in ("rollout", "score", "train"):
            with memory.phase(phase):
                pass
    step = [("wake weights", "host"), ("sync", "host"), ("wake kv_cache", "host"), ("sleep", "host")]
    assert engine.calls == step * 2  # a sync every step: the update changed the actor
    assert memory.engine_states == {"rollout": "awake", "score": f"asleep(level {level})", "train": f"asleep(level {level})"}
    assert {"engine_wake_weights", "engine_sync", "engine_wake_kv_cache", "engine_sleep"} <= set(memory.seconds)


def test_plan_needs_the_actor_for_an_engine_with_its_own_weights():
    with pytest.raises(ValueError, match="needs the actor to sync"):
        PhaseMemory(PhaseMemoryPlan(), rollout_engine=RecordingEngine(None))
