"""The rollout engine's settings: each bad value names its key, and the checks that depend on the
environment (vLLM installed) or on the generation settings."""

from __future__ import annotations

import importlib.util

import pytest

from lightning_mem.rl.engine_config import RolloutEngineConfig
from lightning_mem.rl.rollout import GenerationConfig
from lightning_mem.settings import settings_at


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
