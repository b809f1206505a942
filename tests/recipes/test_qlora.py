"""The QLoRA recipe through its real CLI on the tiny config: training, checkpoints, export, merge."""

import json

import pytest
import torch
from safetensors.torch import load_file

import recipes.qlora as qlora
from lightning_mem import quantized_lora
from lightning_mem.lora import BASE_SIDECAR, load_adapter_model, merge_adapter
from lightning_mem.models import load_causal_lm
from tests.helpers import PROBE_IDS, REPO, fit_and_probe, read_metric, run_recipe, short_fit_args

CONFIG = str(REPO / "configs" / "qlora" / "tiny_cpu.yaml")
STEPS = 24
PROBE = torch.tensor(PROBE_IDS)


def assert_bf16_close(actual, expected):
    # torch's bf16 rtol (8 mantissa bits); atol 2e-2 is about two bf16 steps at the logits' scale
    # (|logit| of a few units): a bf16 forward of merged vs separate weights rounds differently, and
    # one logit in 4,912 was measured 0.0117 off. Merging into the undequantized base misses by ~0.4.
    torch.testing.assert_close(actual, expected, rtol=1.6e-2, atol=2e-2)


def _fit_args(root, *extra):
    return short_fit_args(CONFIG, root, STEPS, *extra)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One short fit, in this process (so the trained model itself can be compared with its export)."""
    root = tmp_path_factory.mktemp("qlora")
    return (root, *fit_and_probe(qlora.main, _fit_args(root, "--trainer.callbacks+=tests.test_gradients.GradientProbe")))


def test_loss_falls(run):
    root, _, _ = run
    losses = [v for _, v in sorted(read_metric(root, "train_loss").items())]
    assert len(losses) == STEPS
    q = STEPS // 4
    assert sum(losses[-q:]) / q < 0.85 * sum(losses[:q]) / q, losses
    assert read_metric(root, "val_loss")  # validation ran through the 4-bit layers too


def test_no_gradient_alive_when_a_step_starts(run):
    # The recipe is an SFTModule (lightning_mem.gradients): the adapters' gradients are freed right
    # after each optimizer step, not in the next step's closure after its forward.
    _, cli, _ = run
    (probe,) = [cb for cb in cli.trainer.callbacks if type(cb).__name__ == "GradientProbe"]
    assert probe.alive == [(i, 0) for i in range(STEPS)]


def test_only_adapters_train_and_the_base_is_4bit(run):
    import bitsandbytes as bnb

    _, cli, _ = run
    model = cli.model.model
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert sum(isinstance(m, bnb.nn.Linear4bit) for m in model.modules()) == 28
    # r=16 on q,k,v,o,gate,up,down of 4 blocks of the tiny Llama
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == 4 * 16 * (
        (256 + 256) * 2 + (256 + 128) * 2 + (256 + 688) * 3
    )
    assert type(cli.trainer.optimizers[0]).__name__ == "PagedAdamW8bit"
    from lightning_mem.activation_checkpointing import is_checkpointed

    blocks = model.base_model.model.model.layers
    assert len(blocks) == 4 and all(is_checkpointed(b) for b in blocks)


def test_checkpoint_holds_the_adapters_only_and_resumes(run, tmp_path):
    root, cli, _ = run
    ckpt = torch.load(root / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu")
    trainable = {f"model.{n}" for n, p in cli.model.model.named_parameters() if p.requires_grad}
    assert set(ckpt["state_dict"]) == trainable
    # Resuming rebuilds the base from name_or_path and restores the adapters and the 8-bit optimizer
    # state: the step counter goes on, and so does the loss instead of starting over.
    qlora.main(
        _fit_args(
            tmp_path,
            f"--trainer.max_steps={STEPS + 2}",
            "--trainer.num_sanity_val_steps=0",
            f"--ckpt_path={root}/checkpoints/last.ckpt",
        )
    )
    resumed, first = read_metric(tmp_path, "train_loss"), read_metric(root, "train_loss")
    assert sorted(resumed) == [STEPS, STEPS + 1]
    assert max(resumed.values()) < 0.9 * sum(first[s] for s in range(4)) / 4


def test_export_is_a_peft_adapter_with_tokenizer(run):
    root, cli, _ = run
    export = root / "export"
    config = json.loads((export / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 16
    linears = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert sorted(config["target_modules"]) == sorted(linears)
    weights = load_file(export / "adapter_model.safetensors")
    assert weights and all(".lora_A." in k or ".lora_B." in k for k in weights)
    assert sum(t.numel() for t in weights.values()) == sum(
        p.numel() for p in cli.model.model.parameters() if p.requires_grad
    )
    assert (export / "tokenizer.json").is_file()
    assert json.loads((export / BASE_SIDECAR).read_text())["quantization"]["quant_type"] == "nf4"


def test_reloaded_adapter_reproduces_the_trained_logits_exactly(run):
    root, _, trained = run
    reloaded = load_adapter_model(root / "export")
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=PROBE).logits, trained)


def test_merge_command_writes_a_bf16_model_matching_the_trained_one(run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, _, trained = run
    out = tmp_path / "merged"
    done = run_recipe("qlora", "merge", "--adapter", str(root / "export"), "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert merged.dtype == torch.bfloat16 and "quantization_config" not in merged.config.to_dict()
    assert not any("4bit" in type(m).__name__ for m in merged.modules())
    assert AutoTokenizer.from_pretrained(out).pad_token_id is not None
    with torch.no_grad():
        logits = merged(input_ids=PROBE).logits.float()
    assert_bf16_close(logits, trained)


def test_merge_into_the_original_base(run, tmp_path):
    from peft import PeftModel

    root, _, trained = run
    out = merge_adapter(root / "export", tmp_path / "merged", base_weights="original")
    adapter = json.loads((root / "export" / "adapter_config.json").read_text())
    unmerged = PeftModel.from_pretrained(
        load_causal_lm(adapter["base_model_name_or_path"], dtype="bfloat16"), str(root / "export")
    ).eval()
    merged = load_causal_lm(str(out))
    assert merged.dtype == torch.bfloat16
    with torch.no_grad():
        original = merged(input_ids=PROBE).logits.float()
        assert_bf16_close(original, unmerged(input_ids=PROBE).logits.float())
    # The adapter was trained against the 4-bit weights: merged into the unquantized checkpoint it
    # drifts from the trained model by the quantization error, which the default merge avoids.
    dequantized = load_causal_lm(str(merge_adapter(root / "export", tmp_path / "deq")))
    with torch.no_grad():
        deq_error = (dequantized(input_ids=PROBE).logits.float() - trained).abs().mean()
    assert deq_error < (original - trained).abs().mean()


# -- bad input: one clear error, before any model is loaded ---------------------------------


@pytest.fixture
def no_model_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the bad input was reported")

    monkeypatch.setattr(quantized_lora, "load_quantized_causal_lm", refuse)  # what the recipe's model loads through


def _cli(tmp_path, *extra):
    root = f"--trainer.default_root_dir={tmp_path}"
    return qlora.main(["fit", "--config", CONFIG, root, "--trainer.max_steps=1", *extra])


def test_unknown_lora_target_lists_the_linear_modules(tmp_path, no_model_load):
    with pytest.raises(ValueError, match=r"`model.lora.target_modules`: \['qkv'\] matches no linear module") as err:
        _cli(tmp_path, "--model.lora.target_modules=[q_proj,qkv]")
    assert "'gate_proj'" in str(err.value) and "'lm_head'" in str(err.value)


def test_disk_offload_without_folder(tmp_path, no_model_load):
    with pytest.raises(ValueError, match=r"`model.offload_folder`"):
        _cli(tmp_path, '--model.device_map={"model": "cpu", "lm_head": "disk"}')


def test_bad_quantization_setting_names_its_key(tmp_path, no_model_load, capsys):
    with pytest.raises(ValueError, match=r"`model.quantization.compute_dtype`: unknown dtype 'float8'"):
        _cli(tmp_path, "--model.quantization.compute_dtype=float8")
    with pytest.raises(SystemExit):  # a value outside a Literal: the parser refuses it, naming the key
        _cli(tmp_path, "--model.quantization.bits=3")
    assert "model.quantization.bits" in capsys.readouterr().err


def test_missing_model_path(tmp_path, no_model_load):
    with pytest.raises(FileNotFoundError, match=r"`model.name_or_path`: model path './no-such-model' does not exist"):
        _cli(tmp_path, "--model.name_or_path=./no-such-model")


def test_merge_without_an_adapter_folder(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match=r"`--adapter`: .* has no adapter_config.json"):
        qlora.main(["merge", "--adapter", str(tmp_path), "--out", str(tmp_path / "out")])
    with pytest.raises(SystemExit):
        qlora.main(["merge", "--adapter", str(tmp_path)])
    assert "--out" in capsys.readouterr().err


# -- placement: a base spread by device_map stays where from_pretrained put it ----------------

DISK_MAP = {
    **{f"model.layers.{i}": "cpu" for i in range(3)},
    **{name: "cpu" for name in ("model.embed_tokens", "model.norm", "model.rotary_emb", "lm_head")},
    "model.layers.3": "disk",  # read from offload_folder at each forward; meta tensors in between
}


def _placed_fit(tmp_path, *extra):
    return qlora.main([
        "fit", "--config", CONFIG, f"--trainer.default_root_dir={tmp_path}", "--trainer.max_steps=2",
        "--model.lr_scheduler.init_args.warmup_steps=1", "--trainer.enable_progress_bar=false", "--trainer.limit_val_batches=0", "--model.export_dir=null",
        f"--model.device_map={json.dumps(DISK_MAP)}", f"--model.offload_folder={tmp_path}/offload", *extra,
    ])  # fmt: skip


def test_device_map_needs_the_placement_strategy(tmp_path, no_model_load):
    with pytest.raises(ValueError, match=r"`model.device_map` is set.*lightning_mem.strategies.DeviceMapStrategy"):
        _placed_fit(tmp_path)


def test_a_base_with_a_layer_on_disk_trains_adapters_on_the_others(tmp_path):
    strategy = '--trainer.strategy={"class_path": "lightning_mem.strategies.DeviceMapStrategy"}'
    cli = _placed_fit(tmp_path, strategy, r"--model.lora.target_modules=model\.layers\.[0-2]\..*_proj")
    model = cli.model.model
    # The disk layer stayed offloaded through setup, training and teardown...
    assert model.base_model.model.model.layers[3].mlp.up_proj.weight.device.type == "meta"
    # ...and the adapters on the other layers trained (lora_B starts at zero).
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert len(lora_b) == 3 * 7 and all(p.abs().sum() > 0 for p in lora_b)
    # Adapters on a disk layer could never step: refused, naming the setting.
    with pytest.raises(ValueError, match=r"`model.device_map`: .* on layers offloaded to disk"):
        _placed_fit(tmp_path, strategy)
