"""The tensor-parallel plan from transformers, translated; the checks that need only a config.

No process group here: the styles are built and inspected, not applied (the gloo runs in
``test_model_parallel.py`` apply them).
"""

from __future__ import annotations

import types

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
from transformers import AutoConfig, GPT2Config, LlamaForCausalLM, Qwen2Config

from lightning_mem.lora import LoraSettings, apply_lora
from lightning_mem.ranks import check_model_splits
from lightning_mem.settings import SettingError, SettingNotSupported, settings_at
from lightning_mem.strategies import FSDP2Strategy
from lightning_mem.strategies.tensor_parallel import (
    SequenceBoundary,
    check_model_parallel,
    lora_styles,
    plan_entries,
    sequence_parallel_plan,
)
from tests.helpers import REPO, TINY_MODEL


@pytest.fixture(scope="module")
def tiny() -> LlamaForCausalLM:
    with torch.device("meta"):
        return LlamaForCausalLM(AutoConfig.from_pretrained(TINY_MODEL))


def test_plan_is_the_architectures_own_with_layer_numbers_filled_in(tiny):
    entries = plan_entries(tiny)
    assert entries["model.embed_tokens"] == "embedding_rowwise"
    assert entries["lm_head"] == "colwise_gather_output"
    for layer in range(4):
        for proj in ("q_proj", "k_proj", "v_proj"):
            assert entries[f"model.layers.{layer}.self_attn.{proj}"] == "colwise"
        assert entries[f"model.layers.{layer}.self_attn.o_proj"] == "rowwise"
        assert entries[f"model.layers.{layer}.mlp.down_proj"] == "rowwise"
    assert len(entries) == 2 + 4 * 7


def test_sequence_parallel_bounds_the_regions_between_the_split_layers(tiny):
    styles = sequence_parallel_plan(tiny, plan_entries(tiny))
    by_name: dict[str, list] = {}
    for name, style in styles:
        by_name.setdefault(name, []).append(style)
    [enter] = by_name.pop("model.layers.0")  # the stack enters the split at its first block
    assert isinstance(enter, SequenceBoundary) and enter.kind == "enter"
    for layer in range(4):
        for region in ("self_attn", "mlp"):  # each region gathers the sequence as it starts
            [gather] = by_name.pop(f"model.layers.{layer}.{region}")
            assert gather.kind == "gather"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            [style] = by_name.pop(f"model.layers.{layer}.{norm}")
            assert isinstance(style, SequenceParallel)
    final, gathered = by_name.pop("model.norm")  # on slices, then whole for the output layer
    assert isinstance(final, SequenceParallel) and gathered.kind == "gather"
    assert by_name == {}


def test_lora_parts_split_with_their_base(tiny):
    model = apply_lora(LlamaForCausalLM(AutoConfig.from_pretrained(TINY_MODEL)),
                       LoraSettings(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "o_proj"]))
    layers = model.get_base_model().model.layers
    colwise = dict(lora_styles(layers[0].self_attn.q_proj, "colwise", sequence_parallel=False))
    assert sorted(colwise) == ["base_layer", "lora_B.default"]  # lora_A reads the whole input
    assert all(isinstance(s, ColwiseParallel) for s in colwise.values())
    rowwise = lora_styles(layers[0].self_attn.o_proj, "rowwise", sequence_parallel=True)
    names = [name for name, _ in rowwise]
    assert names == ["base_layer", "base_layer", "lora_A.default", "lora_A.default", "lora_B.default"]
    base, reduce, _, _, lora_b = (s for _, s in rowwise)
    assert isinstance(base, RowwiseParallel) and base.output_layouts == (Partial(),)
    assert reduce.kind == "reduce" and isinstance(lora_b, SequenceParallel)
    plain = dict(lora_styles(layers[0].self_attn.o_proj, "rowwise", sequence_parallel=False))
    assert sorted(plain) == ["base_layer", "lora_A.default"]
    assert plain["base_layer"].output_layouts == (Replicate(),)


# ---------------------------------------------------------------- what cannot be split


def test_heads_that_do_not_divide_are_refused_naming_the_sizes():
    config = AutoConfig.from_pretrained(TINY_MODEL)  # 8 heads, 4 key/value heads
    check_model_parallel(config, tensor_parallel_size=2, context_parallel_size=2)
    with pytest.raises(SettingError, match=r"^LlamaConfig has 4 key/value heads, which `tensor_parallel_size`=8 does"
                                           r" not divide: each rank must compute attention for whole heads$"):
        check_model_parallel(config, tensor_parallel_size=8)
    with pytest.raises(SettingError, match=r"`tensor_parallel_size`=2 x `context_parallel_size`=4 = 8"):
        check_model_parallel(config, tensor_parallel_size=2, context_parallel_size=4)
    with pytest.raises(SettingError, match=r"^LlamaConfig has 4 key/value heads, which `context_parallel_size`=8 does"):
        check_model_parallel(config, context_parallel_size=8)


def test_models_without_a_plan_or_with_styles_not_applied_are_refused():
    with pytest.raises(SettingNotSupported, match="GPT2Config has no tensor-parallel plan"):
        check_model_parallel(GPT2Config(n_head=4), tensor_parallel_size=2)
    config = Qwen2Config(num_attention_heads=4, num_key_value_heads=2)
    config.base_model_tp_plan = {**config.base_model_tp_plan, "layers.*.mlp.gate_up_proj": "packed_colwise"}
    with pytest.raises(SettingNotSupported, match=r"uses \['packed_colwise'\], which lightning-mem does not apply"):
        check_model_parallel(config, tensor_parallel_size=2)


def test_strategy_arguments_that_cannot_work_fail_at_construction():
    args = r"trainer\.strategy\.init_args"  # where the Trainer takes a strategy's arguments
    with pytest.raises(SettingError, match=rf"^`{args}\.sequence_parallel`: true needs `{args}\.tensor_parallel_size` > 1"):
        FSDP2Strategy(sequence_parallel=True)
    with pytest.raises(SettingError, match=rf"^`{args}\.context_parallel_size` must be an int >= 1, got 0"):
        FSDP2Strategy(context_parallel_size=0)
    with pytest.raises(SettingError, match=rf"^`{args}\.cpu_offload: true` cannot be combined with"
                                           rf" `{args}\.tensor_parallel_size: 2`"):
        FSDP2Strategy(cpu_offload=True, tensor_parallel_size=2)
    FSDP2Strategy(cpu_offload=True, context_parallel_size=2)  # sequences split, shards on the host: fine


def test_a_model_without_heads_and_packing_under_a_split_are_refused_naming_the_key():
    from transformers import PretrainedConfig

    from lightning_mem.ranks import check_packing_splits

    with pytest.raises(SettingNotSupported, match=r"^`context_parallel_size`: \w+ names no"
                                                  r" `num_attention_heads`"):
        check_model_parallel(PretrainedConfig(), context_parallel_size=2)
    trainer = types.SimpleNamespace(strategy=types.SimpleNamespace(tensor_parallel_size=2, context_parallel_size=1))
    with pytest.raises(SettingNotSupported, match=r"^`data.packing: true` with"
                                                  r" `trainer.strategy.init_args.tensor_parallel_size: 2`"):
        check_packing_splits(trainer, packing_key="data.packing")


def test_a_recipe_names_its_yaml_key_before_any_model_loads():
    # What the SFT and PPO recipes do in setup: the strategy checks the config.json, nothing loads.
    trainer = types.SimpleNamespace(strategy=FSDP2Strategy(tensor_parallel_size=8))
    with pytest.raises(SettingError, match=r"^LlamaConfig has 4 key/value heads, which "
                                           r"`trainer\.strategy\.init_args\.tensor_parallel_size`=8 does not divide"):
        with settings_at("trainer.strategy.init_args"):
            check_model_splits(trainer, str(TINY_MODEL))
    check_model_splits(types.SimpleNamespace(strategy=object()), str(TINY_MODEL))  # a strategy that splits nothing


def test_context_parallelism_refuses_sliding_window_attention():
    strategy = FSDP2Strategy(context_parallel_size=2)
    qwen = AutoConfig.from_pretrained(REPO / "assets/hub/Qwen/Qwen2.5-1.5B")  # sliding_window set, unused
    strategy.check_model_config(qwen)
    windowed = Qwen2Config(num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=64,
                           max_window_layers=0)
    with pytest.raises(SettingNotSupported, match="sliding-window or non-attention layers"):
        strategy.check_model_config(windowed)


def test_qlora_refuses_a_split_4bit_base_naming_the_key(tmp_path):
    from recipes.qlora import QLoRAModule

    module = QLoRAModule(name_or_path=str(TINY_MODEL))
    module.trainer = types.SimpleNamespace(strategy=FSDP2Strategy(tensor_parallel_size=2))
    with pytest.raises(SettingNotSupported, match=r"^`trainer\.strategy\.init_args\.tensor_parallel_size`=2: a 4-bit"):
        module.setup("fit")
