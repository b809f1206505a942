"""The weights a sync hands an engine: checkpoint names, LoRA merged under the base names, buckets."""

from __future__ import annotations

import torch

from lightning_mem.models import load_causal_lm
from lightning_mem.rl.weight_sync import checkpoint_weights, weight_buckets
from tests.helpers import TINY_MODEL


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
