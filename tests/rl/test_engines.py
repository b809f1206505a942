"""The rollout engine's config, the weights a sync hands over (names, LoRA merge, buckets), and the
memory plan's engine residency order; all without vLLM (its own tests: test_vllm_engine.py)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from lightning_mem.models import load_causal_lm
from lightning_mem.rl.engines import (
    RolloutEngineConfig,
    build_rollout_engine,
    checkpoint_weights,
    logprob_mismatch,
    weight_buckets,
)
from lightning_mem.rl.memory_plan import PhaseMemory, PhaseMemoryPlan
from lightning_mem.rl.rollout import GenerationConfig, RolloutEngine
from lightning_mem.settings import settings_at
from tests.helpers import TINY_MODEL


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("name", "sglang", r"`model.rollout_engine.name` must be 'hf' or 'vllm'"),
        ("gpu_memory_utilization", 1.5, r"`model.rollout_engine.gpu_memory_utilization` must be in \(0, 1\]"),
        ("max_num_seqs", 0, r"`model.rollout_engine.max_num_seqs` must be >= 1"),
        ("sleep_level", 3, r"`model.rollout_engine.sleep_level` must be 0, 1 or 2"),
        ("sync_bucket_mb", 0, r"`model.rollout_engine.sync_bucket_mb` must be >= 1"),
        ("dtype", "float12", r"`model.rollout_engine.dtype`: unknown dtype 'float12'"),
    ],
)
def test_bad_engine_config_names_the_key(field, value, match):
    # Named as the PPO recipe names the section (the library names the field alone).
    with pytest.raises(ValueError, match=match), settings_at("model.rollout_engine"):
        RolloutEngineConfig(**{field: value})


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_vllm_engine_without_vllm_says_how_to_install():
    with pytest.raises(ValueError, match=r"`model.rollout_engine.name: vllm` needs vLLM.*pip install '\.\[vllm\]'"), settings_at("model"):
        RolloutEngineConfig(name="vllm").validate()


def test_static_kv_cache_is_the_hf_engines_only(monkeypatch):
    """The generation settings are checked with the engine's (one place: the recipe and a directly
    built vLLM engine both call ``validate(generation)``)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))
    static = GenerationConfig(kv_cache="static")
    RolloutEngineConfig(name="hf").validate(static)
    RolloutEngineConfig(name="vllm").validate(GenerationConfig())
    with pytest.raises(ValueError, match=r"`model.generation.kv_cache: static` is the Hugging Face engine's; "
                                         r"`model.rollout_engine.name: vllm` pages its own KV cache"), settings_at("model"):
        RolloutEngineConfig(name="vllm").validate(static)


def test_hf_engine_is_the_default():
    engine = build_rollout_engine(RolloutEngineConfig(), GenerationConfig(), model_path=str(TINY_MODEL), eos_token_ids=[1], pad_token_id=0)
    assert type(engine) is RolloutEngine and not engine.needs_weight_sync


def test_checkpoint_weights_are_the_saved_names_and_tensors():
    torch.manual_seed(0)
    model = load_causal_lm(str(TINY_MODEL))
    got = dict(checkpoint_weights(model))
    expected = {k: v for k, v in model.state_dict().items() if "inv_freq" not in k}
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_lora_actor_yields_merged_weights_under_base_names():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(
        load_causal_lm(str(TINY_MODEL)), LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"])
    )
    with torch.no_grad():  # non-zero adapters, so merging changes something
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.1)
    got = dict(checkpoint_weights(model))
    # The reference: peft's own merge, on a copy.
    import copy

    merged = copy.deepcopy(model).merge_and_unload().state_dict()
    expected = {k: v for k, v in merged.items() if "inv_freq" not in k}
    assert got.keys() == expected.keys()
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=0, atol=1e-6, msg=k)
    assert not torch.equal(got["model.layers.0.self_attn.q_proj.weight"],
                           model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight)
    # The actor itself is untouched: still unmerged, adapters still there.
    assert not model.get_base_model().model.layers[0].self_attn.q_proj.merged


def test_buckets_hold_at_most_their_size_and_cast_each_bucket():
    weights = [(f"w{i}", torch.ones(256, dtype=torch.float32)) for i in range(10)]  # 1 KiB each
    buckets = list(weight_buckets(iter(weights), max_bytes=1024, dtype=torch.bfloat16))  # 512 B each in bf16
    assert [len(b) for b in buckets] == [2, 2, 2, 2, 2]
    assert all(t.dtype == torch.bfloat16 for b in buckets for _, t in b)
    assert [n for b in buckets for n, _ in b] == [n for n, _ in weights]
    # A tensor larger than a bucket is a bucket of its own; integer tensors are not cast.
    big = list(weight_buckets(iter([("a", torch.ones(8)), ("big", torch.ones(1000)), ("i", torch.ones(2, dtype=torch.long))]),
                              max_bytes=64, dtype=torch.bfloat16))
    assert [[n for n, _ in b] for b in big] == [["a"], ["big"], ["i"]]
    assert big[2][0][1].dtype == torch.long


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
