"""4-bit/8-bit bases through bitsandbytes: settings, loading, exact byte accounting, CPU behaviour."""

import math

import bitsandbytes as bnb
import pytest
import torch

from lightning_mem.models import config_only_models, has_weights, load_causal_lm
from lightning_mem.settings import settings_at
from lightning_mem.quantization import (
    QuantizationSettings,
    build_bnb_config,
    check_placement,
    keep_training_layout,
    load_quantized_causal_lm,
    materialize_random_weights,
    quant_state_tensors,
    quantized_weight_bytes,
)
from tests.helpers import TINY_MODEL

FP32 = QuantizationSettings(compute_dtype="float32")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return str(materialize_random_weights(str(TINY_MODEL), tmp_path_factory.mktemp("random_base"), seed=0))


@pytest.fixture(scope="module")
def model4(base):
    return load_quantized_causal_lm(base, FP32)


# -- settings ---------------------------------------------------------------------------------


def test_bnb_config_is_nf4_double_quant_with_the_compute_dtype():
    cfg = build_bnb_config(QuantizationSettings(compute_dtype="bf16", quant_storage="bfloat16"))
    assert cfg.load_in_4bit and not cfg.load_in_8bit
    assert cfg.bnb_4bit_quant_type == "nf4" and cfg.bnb_4bit_use_double_quant
    assert cfg.bnb_4bit_compute_dtype == torch.bfloat16 and cfg.bnb_4bit_quant_storage == torch.bfloat16
    assert build_bnb_config(QuantizationSettings()).bnb_4bit_quant_storage == torch.uint8
    eight = build_bnb_config(QuantizationSettings(bits=8))
    assert eight.load_in_8bit and not eight.load_in_4bit


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"compute_dtype": "float8"}, r"`model.quantization.compute_dtype`: unknown dtype 'float8'"),
        ({"compute_dtype": "auto"}, r"`model.quantization.compute_dtype` must name a dtype"),
        ({"bits": 3}, r"`model.quantization.bits` must be 4 or 8"),
        ({"quant_type": "int4"}, r"`model.quantization.quant_type` must be 'nf4' or 'fp4'"),
        ({"bits": 8, "quant_storage": "bfloat16"}, r"`model.quantization.quant_storage` applies to 4-bit"),
        ({"quant_storage": "float4"}, r"`model.quantization.quant_storage`: unknown dtype"),
    ],
)
def test_bad_settings_name_their_key(kwargs, message):
    with pytest.raises(ValueError, match=message), settings_at("model.quantization"):  # the key the recipes name
        QuantizationSettings(**kwargs)


def test_placement_checks():
    with pytest.raises(ValueError, match=r"`model.max_memory` needs `model.device_map`"), settings_at("model"):
        check_placement(None, {0: "20GiB"}, None)
    with pytest.raises(ValueError, match=r"puts modules on 'disk': set `model.offload_folder`"), settings_at("model"):
        check_placement({"model.layers.0": 0, "model.layers.1": "disk"}, None, None)
    check_placement("auto", {0: "20GiB", "cpu": "64GiB"}, "offload")


# -- loading ----------------------------------------------------------------------------------


def test_random_weights_are_seeded_saved_once_and_leave_the_rng_alone(tmp_path):
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    a = materialize_random_weights(str(TINY_MODEL), tmp_path, seed=0)
    assert torch.equal(torch.rand(1), expected_next)  # the training RNG did not move
    assert has_weights(a) and (a / "tokenizer.json").is_file() and a.is_absolute()
    stamp = (a / "model.safetensors").stat().st_mtime_ns
    assert materialize_random_weights(str(TINY_MODEL), tmp_path, seed=0) == a
    assert (a / "model.safetensors").stat().st_mtime_ns == stamp  # reused, not rewritten
    b = materialize_random_weights(str(TINY_MODEL), tmp_path, seed=1)
    assert b != a
    wa, wb = load_causal_lm(str(a)).lm_head.weight, load_causal_lm(str(b)).lm_head.weight
    assert not torch.equal(wa, wb)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([a.name, b.name])  # no temporaries left


def test_linear_layers_load_as_nf4_and_the_head_stays_dense(model4):
    layers = [m for m in model4.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(layers) == 4 * 7  # q k v o gate up down per block
    state = layers[0].weight.quant_state
    assert state.quant_type == "nf4" and state.nested and state.blocksize == 64
    assert layers[0].weight.dtype == torch.uint8
    assert type(model4.lm_head) is torch.nn.Linear  # transformers keeps the output head unquantized


def test_4bit_weights_take_at_most_0_3_of_bf16_exactly_counted(model4):
    held, dense = quantized_weight_bytes(model4)
    expected_held = expected_dense = 0
    for m in model4.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            n = m.in_features * m.out_features
            blocks = math.ceil(n / 64)
            expected_held += (
                math.ceil(n / 2)  # two 4-bit codes per byte
                + blocks  # absmax, itself quantized to 8 bits (double quantization)
                + math.ceil(blocks / 256) * 4  # fp32 scales of the absmax blocks
                + 4  # fp32 mean subtracted from the absmax before quantizing it
                + 16 * 4  # the NF4 code book, fp32
                + 256 * 4  # the 8-bit code book of the absmax, fp32
            )
            expected_dense += n * 2
    assert (held, dense) == (expected_held, expected_dense)
    assert held / dense <= 0.3, held / dense


def test_double_quantization_saves_bytes(base):
    single = load_quantized_causal_lm(base, QuantizationSettings(compute_dtype="float32", double_quant=False))
    held_single, dense = quantized_weight_bytes(single)
    held_double, _ = quantized_weight_bytes(load_quantized_causal_lm(base, FP32))
    assert held_double < held_single  # fp32 absmax (4 B per 64 weights) vs 8-bit absmax (1 B per 64)


def test_8bit_loading_works_on_cpu(base):
    model = load_quantized_causal_lm(base, QuantizationSettings(bits=8, compute_dtype="float32"))
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear8bitLt)]
    assert len(layers) == 28 and layers[0].weight.dtype == torch.int8
    held, dense = quantized_weight_bytes(model)
    assert held == sum(m.in_features * m.out_features + m.out_features * 4 for m in layers)  # int8 + fp32 row scales
    ids = torch.tensor([[5, 6, 7, 8]])
    assert model(input_ids=ids, labels=ids).loss.isfinite()


def test_4bit_forward_and_backward_run_on_cpu_and_match_the_dequantized_weights():
    torch.manual_seed(0)
    layer = bnb.nn.Linear4bit(128, 96, bias=False, compute_dtype=torch.float32, quant_type="nf4")
    layer.weight = bnb.nn.Params4bit(torch.randn(96, 128), requires_grad=False, quant_type="nf4").to("cpu")
    dense = bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state)
    x = torch.randn(3, 128, requires_grad=True)
    y = layer(x)
    torch.testing.assert_close(y, x @ dense.T)
    y.sum().backward()
    torch.testing.assert_close(x.grad, dense.sum(0).expand(3, -1))


def test_evaluation_does_not_break_the_gradient_through_4bit_layers():
    # bitsandbytes repacks 4-bit weights for an inference kernel (no backward) on AVX512-BF16 CPUs
    # at the first eval-mode no-grad forward; keep_training_layout must prevent it.
    torch.manual_seed(0)
    layer = bnb.nn.Linear4bit(64, 64, bias=False, compute_dtype=torch.float32, quant_type="nf4")
    layer.weight = bnb.nn.Params4bit(torch.randn(64, 64), requires_grad=False, quant_type="nf4").to("cpu")
    model = torch.nn.Sequential(layer)
    assert keep_training_layout(model) == 1
    packed = layer.weight.data.clone()
    with torch.no_grad():
        model.eval()(torch.randn(2, 64))
    assert torch.equal(layer.weight.data, packed)
    dense = bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state)
    x = torch.randn(2, 64, requires_grad=True)
    model.train()(x).sum().backward()
    torch.testing.assert_close(x.grad, dense.sum(0).expand(2, -1))


# -- FSDP2: the 4-bit base sharded by torch's fully_shard over 2 CPU ranks (gloo) -------------


def _qlora_model(base: str):
    from peft import prepare_model_for_kbit_training

    from lightning_mem.lora import LoraSettings, apply_lora

    # quant_storage = the parameters' dtype: the packed weights are then ordinary fp32 tensors
    # to FSDP (the setting FSDP1 requires and FSDP2 recipes use).
    model = load_quantized_causal_lm(base, QuantizationSettings(compute_dtype="float32", quant_storage="float32"))
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    torch.manual_seed(1)  # the same adapter initialisation on every rank and in the reference
    return apply_lora(model, LoraSettings(r=4, lora_dropout=0.0))


def _packed_bytes(model) -> int:
    return sum(
        (p.to_local() if hasattr(p, "to_local") else p).untyped_storage().nbytes()
        for n, p in model.named_parameters()
        if n.endswith("base_layer.weight")
    )


def _fsdp2_rank(rank: int, base: str, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    try:
        mesh = init_device_mesh("cpu", (2,))
        model = _qlora_model(base)
        for block in model.base_model.model.model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        ids = torch.arange(2, 34).view(2, 16)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.requires_grad}
        torch.save({"loss": loss.detach(), "grads": grads, "packed": _packed_bytes(model)}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_fsdp2_shards_the_4bit_base_and_changes_no_result(base, tmp_path):
    import socket

    import torch.multiprocessing as mp

    reference = _qlora_model(base)
    ids = torch.arange(2, 34).view(2, 16)
    loss = reference(input_ids=ids, labels=ids).loss
    loss.backward()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_fsdp2_rank, args=(base, port, str(tmp_path)), nprocs=2)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert torch.equal(got["loss"], loss.detach())
        for name, p in reference.named_parameters():
            if p.requires_grad:
                torch.testing.assert_close(got["grads"][name], p.grad, rtol=1e-5, atol=1e-7)
        assert got["packed"] * 2 == _packed_bytes(reference)  # each rank holds half the 4-bit weights


# -- built from config alone (the memory estimate's path) ---------------------------------------


def _quantized_tensors(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)):
            out[f"{name}.weight"] = m.weight.data
            for i, t in enumerate(quant_state_tensors(m.weight)):
                out[f"{name}.state{i}"] = t
    out.update({n: p.data for n, p in model.named_parameters() if not n.endswith(".weight") or n not in out})
    return out


@pytest.mark.parametrize("bits", [4, 8])
def test_built_from_config_is_what_loading_seeded_weights_gives(base, bits, tmp_path):
    """The config-only path quantizes through the same transformers/bitsandbytes steps as a load:
    with the same seeded random weights, every packed byte and quantization-state value is equal."""
    settings = QuantizationSettings(bits=bits, compute_dtype="float32")
    loaded = load_quantized_causal_lm(base, settings)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # materialize_random_weights' seed for `base`
        with config_only_models():
            built = load_quantized_causal_lm(str(TINY_MODEL), settings, random_init_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []  # nothing written
    assert type(built) is type(loaded) and getattr(built, f"is_loaded_in_{bits}bit")
    a, b = _quantized_tensors(loaded), _quantized_tensors(built)
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
        assert torch.equal(a[key], b[key]), key
    assert quantized_weight_bytes(built) == quantized_weight_bytes(loaded)
    ids = torch.tensor([[5, 6, 7, 8]])
    torch.testing.assert_close(built(input_ids=ids).logits, loaded(input_ids=ids).logits, rtol=0, atol=0)


def test_config_only_refuses_a_device_map():
    with config_only_models(), pytest.raises(NotImplementedError, match="`device_map`"):
        load_quantized_causal_lm(str(TINY_MODEL), FP32, device_map={"": "cpu"})


def test_config_only_device_map_error_names_the_recipes_key():
    # The QLoRA recipe loads its base under settings_at("model"): the same error names its YAML key.
    with config_only_models(), pytest.raises(NotImplementedError, match=r"^`model\.device_map`: a base placed"):
        with settings_at("model"):
            load_quantized_causal_lm(str(TINY_MODEL), FP32, device_map={"": "cpu"})
