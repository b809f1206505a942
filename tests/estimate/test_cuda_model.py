"""The estimate's CUDA device model (lightning_mem/estimate/cuda.py): its parts on the tiny model,
and the PPO 0.5B config's estimate held to its H100 measurement (docs/will_it_fit.md, "The estimate
on CUDA")."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lightning_mem.estimate.cuda import (
    CUBLAS_WORKSPACE_BYTES,
    CUBLASLT_WORKSPACE_BYTES,
    CudaDeviceModel,
    padded_attention_masks,
)
from lightning_mem.estimate.tracker import MemoryLedger

ROOT = Path(__file__).resolve().parents[2]


def test_the_ledger_counts_a_storage_as_the_allocators_block():
    ledger = MemoryLedger()
    ledger.round_bytes = 512
    small, exact, large = torch.empty(100, dtype=torch.uint8), torch.empty(1024), torch.empty(1000, 3)
    for t in (small, exact, large):
        ledger.track(t)
    assert ledger.device_bytes == 512 + 4096 + 12288  # 100 -> 512, 4,096 stays, 12,000 -> 12,288


def test_two_threads_hold_a_cublas_and_a_cublaslt_workspace_each():
    assert CUBLAS_WORKSPACE_BYTES == 32 << 20 and CUBLASLT_WORKSPACE_BYTES == 1 << 20
    assert CudaDeviceModel.for_run(trains=True).workspace_bytes == 66 << 20
    assert CudaDeviceModel.for_run(trains=False).workspace_bytes == 33 << 20


def _sdpa_masks(model, ids, mask):
    seen = []
    original = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kwargs):
        seen.append((None if attn_mask is None else tuple(attn_mask.shape), tuple(k.shape), kwargs.get("enable_gqa", False)))
        return original(q, k, v, attn_mask=attn_mask, **kwargs)

    from transformers.integrations import sdpa_attention

    sdpa_attention.torch.nn.functional.scaled_dot_product_attention = spy
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
    finally:
        sdpa_attention.torch.nn.functional.scaled_dot_product_attention = original
    return seen


def test_a_full_mask_takes_the_padded_path_while_active():
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_mem.assets import TINY_MODEL

    config = AutoConfig.from_pretrained(TINY_MODEL)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    assert kv_heads < heads  # grouped-query attention, as Qwen2.5's
    ids = torch.full((2, 6), 5)
    mask = torch.ones_like(ids)
    plain = _sdpa_masks(model, ids, mask)
    assert plain and all(m is None and k[1] == kv_heads and gqa for m, k, gqa in plain)  # unmasked, K/V not repeated
    active = [True]
    with padded_attention_masks(lambda: active[0]):
        padded = _sdpa_masks(model, ids, mask)
        active[0] = False
        off = _sdpa_masks(model, ids, mask)
    assert padded and all(m == (2, 1, 6, 6) and k[1] == heads and not gqa for m, k, gqa in padded)
    assert off == plain  # outside a PPO phase, and after the block, transformers decides as before
    assert _sdpa_masks(model, ids, mask) == plain


# -- the H100 figures (issue #36), in the config-gate step: one PPO estimate, minutes on 2 cores --

#: ``torch.cuda.max_memory_allocated`` per phase, H100 80GB capped to 24 GiB, torch 2.11.0+cu130,
#: 2026-11-26 (benchmarks/gpu/tiers.py; issue #36). The rollout then ran Hugging Face ``generate``
#: with the LoRA adapters unmerged; the config has sampled with the static decode loop since
#: 2026-11-27 (issue #43), whose rollout has not been measured through the tier runner yet.
H100_PPO_0_5B = {"rollout": 16_593_176_064, "score": 2_610_343_424, "train": 13_001_281_536}
#: The rollout path that measurement ran.
MEASURED_ROLLOUT = ["--model.generation.kv_cache=dynamic", "--model.generation.compile=false",
                    "--model.generation.merge_lora=false"]


@pytest.mark.config_gate
def test_the_ppo_0_5b_estimate_holds_to_its_h100_measurement():
    from lightning_mem.estimate import estimate

    result = estimate(ROOT / "configs/ppo/qwen2.5-0.5b-instruct_1x24gb.yaml", MEASURED_ROLLOUT, world_size=1)
    ratios = {p.phase: p.device_peak_bytes / H100_PPO_0_5B[p.phase] for p in result.phases}
    assert set(ratios) == set(H100_PPO_0_5B)
    for phase, ratio in ratios.items():
        assert 0.98 <= ratio <= 1.05, ratios  # never more than 2 % under the GPU, at most 5 % over
