"""The vLLM rollout engine in the estimate (:mod:`lightning_mem.estimate.engine`).

The estimate runs the PPO recipe's own fit with a stand-in for the engine (vLLM does not run on
fake tensors, and need not be installed for an estimate). What the stand-in holds follows vLLM's
rules: on a CUDA device ``gpu_memory_utilization`` of the device's total while awake, the weights
on the host at sleep level 1, nothing at level 2; on the CPU build its weights and
``cpu_kv_cache_space_gb`` in every phase. Its rollout runs no decoding through the actor.
Where vLLM is installed (``.venv-vllm``), the estimate is held to the recipe's real fit with the
engine, as the other configs are (tests/estimate/test_estimate_accuracy.py).
"""

from __future__ import annotations

import pytest

from lightning_mem.estimate import estimate
from lightning_mem.estimate.measure import filling_rows
from tests.estimate.test_estimate_accuracy import _held
from tests.helpers import TINY_MODEL

CONFIG = "configs/ppo/tiny_cpu.yaml"
BASE = ["--model.name_or_path", str(TINY_MODEL)]
VLLM = [*BASE, "--model.rollout_engine.name", "vllm"]
TINY_WEIGHT_BYTES = 3_059_456 * 4  # the tiny actor's fp32 weights: the engine's copy
GiB = 1 << 30
pytestmark = pytest.mark.timeout(900)


def _phases(est):
    return {p.phase: p for p in est.phases}


@pytest.fixture(scope="module")
def hf():
    return _phases(estimate(CONFIG, BASE))


def test_on_the_cpu_the_engine_holds_its_weights_and_kv_cache_in_every_phase(hf):
    est = _phases(estimate(CONFIG, [*VLLM, "--model.rollout_engine.cpu_kv_cache_space_gb", "1"]))
    for name in ("rollout", "score", "train"):
        b, base = est[name].device_breakdown_bytes, hf[name].device_breakdown_bytes
        assert b["kv_cache"] == GiB, name
        assert b["weights"] - base["weights"] == TINY_WEIGHT_BYTES, name
    # The rollout decodes inside vLLM: none of generate's activations or KV cache on the trainer's side.
    assert hf["rollout"].device_breakdown_bytes["activations"] > 0
    assert est["rollout"].device_breakdown_bytes["activations"] < hf["rollout"].device_breakdown_bytes["activations"] / 100
    # Scoring and training run as they do with the Hugging Face engine (beside the engine's own
    # logprobs of the sampled tokens, kept as a diagnostic).
    for name in ("score", "train"):
        assert est[name].device_breakdown_bytes["activations"] == pytest.approx(
            hf[name].device_breakdown_bytes["activations"], rel=1e-3)


@pytest.fixture(scope="module")
def hf_cuda():
    # The same config on a GPU: the estimate's CUDA device model (cuBLAS workspaces, 512-byte blocks)
    # is in both sides of the comparisons below.
    return _phases(estimate(CONFIG, [*BASE, "--trainer.accelerator", "gpu"], device_memory=2 * GiB))


@pytest.mark.parametrize("level", [1, 2])
def test_on_cuda_the_engine_takes_its_share_awake_and_sleeps_at_its_level(hf_cuda, level):
    hf = hf_cuda
    util = 0.25
    est = _phases(estimate(CONFIG, [*VLLM, "--trainer.accelerator", "gpu",
                                    "--model.rollout_engine.gpu_memory_utilization", str(util),
                                    "--model.rollout_engine.sleep_level", str(level)], device_memory=2 * GiB))
    rollout, base = est["rollout"].device_breakdown_bytes, hf["rollout"].device_breakdown_bytes
    # Awake: its weights and the rest of its share of the device (KV cache, work space).
    assert rollout["weights"] - base["weights"] + rollout["kv_cache"] == int(util * 2 * GiB)
    assert rollout["weights"] - base["weights"] == TINY_WEIGHT_BYTES
    for name in ("score", "train"):
        b = est[name].device_breakdown_bytes
        assert b.get("kv_cache", 0) == 0 and b["weights"] == hf[name].device_breakdown_bytes["weights"], name
        # Level 1 keeps the weights in host memory until the next rollout; level 2 drops them.
        held = TINY_WEIGHT_BYTES if level == 1 else 0
        assert est[name].host_peak_bytes - hf[name].host_peak_bytes == held, name


def test_on_cuda_the_engine_needs_the_devices_size():
    with pytest.raises(ValueError, match="--device-memory"):
        estimate(CONFIG, [*VLLM, "--trainer.accelerator", "gpu"])


@pytest.mark.vllm
def test_the_estimate_holds_to_a_real_fit_with_vllm(tmp_path):
    """Measured on 2026-11-25 (2-core CPU): every phase's estimate 1.004-1.006 of the real fit's."""
    est, _ = _held(CONFIG, [*filling_rows(tmp_path)["ppo"], "--model.rollout_engine.name", "vllm",
                            "--model.rollout_engine.cpu_kv_cache_space_gb", "1"])
    assert [p.phase for p in est.phases] == ["rollout", "engine_sleep", "score", "train"]
