"""LoRA adapters: which modules get them, exactly how many parameters train, and clear errors."""

import re

import bitsandbytes as bnb
import pytest
import torch

from lightning_mem.lora import LoraSettings, apply_lora, check_lora_targets, linear_module_names, meta_model
from lightning_mem.models import count_parameters
from lightning_mem.settings import settings_at
from lightning_mem.quantization import QuantizationSettings, load_quantized_causal_lm, materialize_random_weights
from tests.helpers import TINY_MODEL

FP32 = QuantizationSettings(compute_dtype="float32")
BLOCK_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return str(materialize_random_weights(str(TINY_MODEL), tmp_path_factory.mktemp("random_base"), seed=0))


def _lora_count(model, names, r):
    """r x (in + out) for every linear whose name ends with one of ``names``, from the model's own shapes."""
    return sum(
        r * (m.in_features + m.out_features)
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in names
    )


def test_all_linear_trains_exactly_r_times_in_plus_out_per_block_linear(base):
    model = load_quantized_causal_lm(base, FP32)
    expected = _lora_count(model, BLOCK_LINEARS, r=8)
    assert expected == 4 * 8 * ((256 + 256) * 2 + (256 + 128) * 2 + (256 + 688) * 3)  # tiny Llama's shapes
    peft_model = apply_lora(model, LoraSettings(r=8))
    trainable = {n: p for n, p in peft_model.named_parameters() if p.requires_grad}
    assert sum(p.numel() for p in trainable.values()) == expected
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert not any("lm_head" in n for n in trainable)  # the output head is not a LoRA target
    # the frozen base is still the 4-bit one
    assert sum(isinstance(m, bnb.nn.Linear4bit) for m in peft_model.modules()) == 28


def test_listed_targets_and_modules_to_save(base):
    model = load_quantized_causal_lm(base, FP32)
    head = model.lm_head.weight.numel()
    peft_model = apply_lora(model, LoraSettings(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"]))
    trainable = {n: p for n, p in peft_model.named_parameters() if p.requires_grad}
    lora = sum(p.numel() for n, p in trainable.items() if ".lora_" in n)
    assert lora == 4 * 4 * ((256 + 256) + (256 + 128))
    assert sum(p.numel() for n, p in trainable.items() if ".lora_" not in n) == head  # a trainable copy of lm_head
    assert count_parameters(peft_model, trainable_only=True) == lora + head


def test_a_regex_target_is_matched_against_full_names(base):
    model = load_quantized_causal_lm(base, FP32)
    peft_model = apply_lora(model, LoraSettings(r=2, target_modules=r"model\.layers\.[01]\.mlp\.down_proj"))
    assert count_parameters(peft_model, trainable_only=True) == 2 * 2 * (688 + 256)


@pytest.mark.parametrize(
    "targets, bad",
    [(["q_proj", "qkv_proj"], r"\['qkv_proj'\] matches no linear module"), ("attn\\..*", r"regex 'attn\\\\..\*'")],
)
def test_targets_that_match_nothing_list_the_linear_modules(targets, bad):
    model = meta_model(str(TINY_MODEL))
    with pytest.raises(ValueError) as err, settings_at("model.lora"):  # the key the recipes name
        check_lora_targets(model, LoraSettings(target_modules=targets))
    message = str(err.value)
    assert message.startswith("`model.lora.target_modules`:")
    assert re.search(bad, message), message
    for name in [*BLOCK_LINEARS, "lm_head"]:
        assert f"'{name}'" in message


def test_unknown_modules_to_save_are_named():
    with pytest.raises(ValueError, match=r"`model.lora.modules_to_save`: \['lm_haed'\] name no module"), settings_at("model.lora"):
        check_lora_targets(meta_model(str(TINY_MODEL)), LoraSettings(modules_to_save=["lm_haed"]))


def test_meta_twin_has_the_real_models_linear_names(base):
    # Targets are checked on a meta-device twin before loading; it must see what the real load sees.
    assert linear_module_names(meta_model(str(TINY_MODEL))) == linear_module_names(load_quantized_causal_lm(base, FP32))
    assert next(meta_model(str(TINY_MODEL)).parameters()).device.type == "meta"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"r": 0}, r"`model.lora.r` must be positive"),
        ({"lora_alpha": 0}, r"`model.lora.lora_alpha` must be positive"),
        ({"bias": "some"}, r"`model.lora.bias` must be 'none', 'all' or 'lora_only'"),
        ({"lora_dropout": 1.0}, r"`model.lora.lora_dropout` must be in \[0, 1\)"),
        ({"target_modules": []}, r"`model.lora.target_modules` is empty"),
        ({"target_modules": "q_proj("}, r"`model.lora.target_modules`: 'q_proj\(' is not a valid regex"),
    ],
)
def test_bad_lora_settings_name_their_key(kwargs, message):
    with pytest.raises(ValueError, match=message), settings_at("model.lora"):  # the key the recipes name
        LoraSettings(**kwargs)


def test_saved_base_writes_random_weights_except_when_building_from_config(tmp_path):
    from types import SimpleNamespace

    from lightning_mem.lora import saved_base
    from lightning_mem.models import config_only_models, has_weights

    class _Strategy:
        def barrier(self, name):
            pass

    trainer = SimpleNamespace(default_root_dir=str(tmp_path), is_global_zero=True, strategy=_Strategy())
    with config_only_models():  # the memory estimate: the config folder itself, nothing written
        assert saved_base(trainer, str(TINY_MODEL), "random_base", seed=0) == str(TINY_MODEL)
    assert list(tmp_path.iterdir()) == []
    written = saved_base(trainer, str(TINY_MODEL), "random_base", seed=0)
    assert written.startswith(str(tmp_path / "random_base")) and has_weights(written)
