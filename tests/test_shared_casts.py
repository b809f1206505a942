"""Linear layers reading one fp32 tensor share its autocast copy: same numbers, fewer bytes kept."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from lightning_mem import shared_casts
from lightning_mem.shared_casts import share_input_casts, unshare_input_casts

QWEN = "assets/hub/Qwen/Qwen2.5-0.5B-Instruct"


def _qwen(layers: int = 2, hidden: int = 64, fake: bool = False) -> nn.Module:
    """Qwen2.5's architecture (biased q/k/v, GQA, tied embeddings), made small."""
    config = AutoConfig.from_pretrained(QWEN)
    config.num_hidden_layers, config.hidden_size, config.intermediate_size = layers, hidden, 2 * hidden
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 4, 2, hidden // 4
    config.vocab_size = 1000
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _bf16():  # Lightning's bf16-mixed: autocast with its cast cache off
    return torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False)


def _loss_and_grads(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with _bf16():
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_same_loss_and_gradients_to_the_bit(checkpointing):
    plain = _qwen()
    shared = copy.deepcopy(plain)
    # q, k, v, o, gate, up, down per block, and the output layer.
    assert share_input_casts(shared) == 2 * 7 + 1
    for model in (plain, shared):
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    ids = torch.randint(0, 1000, (2, 48))
    loss_a, grads_a = _loss_and_grads(plain, ids)
    loss_b, grads_b = _loss_and_grads(shared, ids)
    assert torch.equal(loss_a, loss_b)
    for name, grad in grads_a.items():
        assert torch.equal(grad, grads_b[name]), name


def _saved_bytes(model: nn.Module, ids: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd keeps for backward in one forward, parameters aside."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _bf16():
        out = model(input_ids=ids)
    del out
    return sum(kept.values())


def test_three_fewer_bf16_copies_of_the_normalized_input_per_block():
    layers, hidden, rows, width = 3, 64, 2, 40
    plain = _qwen(layers, hidden)
    ids = torch.randint(0, 1000, (rows, width))
    before = _saved_bytes(plain, ids)
    share_input_casts(plain)
    after = _saved_bytes(plain, ids)
    # q/k/v read one normalized tensor (two copies fewer), gate/up another (one fewer): bf16, 2 bytes.
    assert before - after == layers * 3 * rows * width * hidden * 2


def test_nothing_is_shared_or_kept_outside_autocast_or_for_a_bf16_input():
    layer = nn.Linear(8, 4)
    share_input_casts(layer)
    x = torch.randn(3, 8, requires_grad=True)
    shared_casts._CASTS.clear()
    assert torch.equal(layer(x), nn.functional.linear(x, layer.weight, layer.bias))
    with _bf16():
        layer(x.detach().bfloat16())
    assert not shared_casts._CASTS


def test_an_input_changed_in_place_is_cast_again():
    first, second = nn.Linear(8, 4), nn.Linear(8, 4)
    reference = [copy.deepcopy(first), copy.deepcopy(second)]
    share_input_casts(first), share_input_casts(second)
    x = torch.randn(3, 8)
    with _bf16():
        a = first(x)
        x.add_(1.0)  # the next reader must see the new values, not the first reader's copy
        b = second(x)
        x.sub_(1.0)
        ra = reference[0](x)
        x.add_(1.0)
        rb = reference[1](x)
    assert torch.equal(a, ra) and torch.equal(b, rb)


def test_the_cache_holds_nothing_alive():
    layer = nn.Linear(8, 4)
    share_input_casts(layer)
    x = torch.randn(3, 8, requires_grad=True)
    with _bf16():
        out = layer(x)
    (key,) = [k for k in shared_casts._CASTS if k == id(x)]
    del out, x  # the layer's saved cast and the input gone: the entry goes with the input
    assert key not in shared_casts._CASTS


def test_compiled_layers_take_the_plain_path_without_a_graph_break():
    model = _qwen(layers=1)
    share_input_casts(model)
    block = model.model.layers[0]
    compiled = torch.compile(block, backend="eager", fullgraph=True)
    x = torch.randn(2, 16, 64, requires_grad=True)
    position = torch.arange(16).unsqueeze(0)
    embeddings = model.model.rotary_emb(x, position)
    with _bf16():
        out = compiled(x, position_embeddings=embeddings, attention_mask=None)
        expected = block(x, position_embeddings=embeddings, attention_mask=None)
    out = out[0] if isinstance(out, tuple) else out
    expected = expected[0] if isinstance(expected, tuple) else expected
    torch.testing.assert_close(out, expected)


def test_unshare_restores_the_class_forward_and_sharing_twice_changes_nothing():
    model = _qwen(layers=1)
    count = share_input_casts(model)
    assert share_input_casts(model) == count
    assert unshare_input_casts(model) == count
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_lora_base_and_adapter_layers_share_the_cast():
    from peft import LoraConfig, get_peft_model

    plain = get_peft_model(_qwen(), LoraConfig(r=4, target_modules=["q_proj", "v_proj", "gate_proj"],
                                               lora_dropout=0.0, init_lora_weights=False))
    shared = copy.deepcopy(plain)
    assert share_input_casts(shared) > 0
    ids = torch.randint(0, 1000, (2, 32))
    loss_a, grads_a = _loss_and_grads(plain, ids)
    loss_b, grads_b = _loss_and_grads(shared, ids)
    assert torch.equal(loss_a, loss_b)
    for name, grad in grads_a.items():
        if grad is not None:
            assert torch.equal(grad, grads_b[name]), name
    assert _saved_bytes(shared, ids) < _saved_bytes(plain, ids)


def test_a_layer_whose_instance_has_its_own_forward_is_left_alone():
    """accelerate's device-map hooks set ``forward`` on the instance (it loads the weight there): replacing
    it would compute with an offloaded layer's placeholder weight."""
    hooked, plain = nn.Linear(8, 4), nn.Linear(8, 4)
    calls = []

    def own_forward(x):
        calls.append(1)
        return nn.Linear.forward(hooked, x)

    hooked.forward = own_forward
    assert share_input_casts(nn.ModuleList([hooked, plain])) == 1
    assert hooked.forward is own_forward
    hooked(torch.randn(2, 8))
    assert calls == [1]


def test_inference_mode_under_autocast_takes_autocasts_own_path():
    """Lightning validates under ``torch.inference_mode`` inside the precision's autocast; inference
    tensors have no version counter to check, and keep nothing for a backward."""
    layer = nn.Linear(8, 4)
    reference = copy.deepcopy(layer)
    share_input_casts(layer)
    shared_casts._CASTS.clear()
    with torch.inference_mode(), _bf16():
        x = torch.randn(3, 8)
        out, expected = layer(x), reference(x)
    assert torch.equal(out, expected) and not shared_casts._CASTS


def test_the_sft_recipe_shares_casts_while_it_fits_and_validates_under_bf16_mixed(tmp_path):
    import recipes.sft as sft
    from lightning_mem.callbacks import SharedCasts
    from tests.helpers import REPO

    cli = sft.main(["fit", "--config", str(REPO / "configs" / "sft" / "tiny_cpu.yaml"),
                    f"--trainer.default_root_dir={tmp_path}", "--trainer.precision=bf16-mixed", "--trainer.max_steps=2",
                    "--trainer.val_check_interval=1", "--trainer.limit_val_batches=1", "--model.export_dir=null",
                    "--trainer.enable_progress_bar=false"])
    (callback,) = [c for c in cli.trainer.callbacks if isinstance(c, SharedCasts)]
    assert callback.layers > 0  # patched for the fit (validation under inference_mode included)...
    assert not any("forward" in m.__dict__ for m in cli.model.modules())  # ...and restored after it
    assert cli.trainer.global_step == 2
