"""LoRA SFT (no quantization) through the real CLI on the tiny config: the loss falls, only the
adapters train and are checkpointed, the exported adapter reloads bit-identically, and merge
writes a plain Hugging Face model."""

import json

import pytest
import torch
from safetensors.torch import load_file

import recipes.sft as sft
from lightning_mem.lora import BASE_SIDECAR, load_adapter_model
from tests.helpers import PROBE_IDS, REPO, fit_and_probe, read_metric, run_recipe, short_fit_args

CONFIG = str(REPO / "configs" / "sft" / "tiny_cpu_lora.yaml")
STEPS = 24
PROBE = torch.tensor(PROBE_IDS)
BLOCK_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _fit_args(root, *extra):
    return short_fit_args(CONFIG, root, STEPS, f"--model.lr_scheduler.init_args.total_steps={STEPS}", *extra)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One short fit in this process, so the trained model itself can be compared with its export."""
    root = tmp_path_factory.mktemp("sft_lora")
    return (root, *fit_and_probe(sft.main, _fit_args(root)))


def test_loss_falls(run):
    root, _, _ = run
    losses = read_metric(root, "train_loss")
    assert len(losses) == STEPS
    first, last = [sum(losses[s] for s in steps) / 4 for steps in (range(4), range(STEPS - 4, STEPS))]
    assert last < 0.8 * first, (first, last)


def test_only_adapters_train_on_a_full_precision_base(run):
    _, cli, _ = run
    model = cli.model.model
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # r x (in + out) for each of the 7 block linears of the 4 blocks (the tiny Llama's shapes)
    assert sum(p.numel() for p in trainable.values()) == 4 * 16 * ((256 + 256) * 2 + (256 + 128) * 2 + (256 + 688) * 3)
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert {p.dtype for p in frozen} == {torch.float32}
    assert not any("4bit" in type(m).__name__ for m in model.modules())


def test_checkpoint_holds_the_adapters_only_and_resumes(run, tmp_path):
    root, cli, _ = run
    ckpt = torch.load(root / "checkpoints" / "last.ckpt", weights_only=False)
    trainable = {n for n, p in cli.model.named_parameters() if p.requires_grad}
    assert set(ckpt["state_dict"]) == trainable
    assert ckpt["global_step"] == STEPS
    resumed = sft.main(_fit_args(root, f"--trainer.max_steps={STEPS + 2}", "--ckpt_path=last",
                                 f"--trainer.logger.save_dir={tmp_path}", "--model.export_dir=null"))
    assert resumed.trainer.global_step == STEPS + 2
    assert sorted(read_metric(tmp_path, "train_loss")) == [STEPS, STEPS + 1]


def test_export_is_a_peft_adapter_that_reloads_bit_identically(run):
    root, cli, trained = run
    export = root / "export"
    config = json.loads((export / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 16 and config["lora_alpha"] == 32
    assert sorted(config["target_modules"]) == sorted(BLOCK_LINEARS)
    weights = load_file(export / "adapter_model.safetensors")
    assert sum(t.numel() for t in weights.values()) == sum(
        p.numel() for p in cli.model.model.parameters() if p.requires_grad
    )
    assert json.loads((export / BASE_SIDECAR).read_text())["quantization"] is None
    assert (export / "tokenizer.json").is_file()
    reloaded = load_adapter_model(export)
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=PROBE).logits, trained)


def test_merge_writes_a_plain_hf_model_with_the_trained_outputs(run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, _, trained = run
    out = tmp_path / "merged"
    done = run_recipe("sft", "merge", "--adapter", str(root / "export"), "--out", str(out), "--dtype", "float32")
    assert done.returncode == 0, done.stderr[-3000:]
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert type(merged).__name__ == "LlamaForCausalLM" and merged.dtype == torch.float32
    assert not (out / "adapter_config.json").exists()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    assert AutoTokenizer.from_pretrained(out).pad_token_id is not None
    with torch.no_grad():
        # W + B A folded in fp32: the same function up to float rounding of the sum.
        torch.testing.assert_close(merged(input_ids=PROBE).logits, trained, rtol=1e-4, atol=1e-4)


# -- bad input: one clear error, before any model is loaded ---------------------------------


@pytest.fixture
def no_model_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the bad input was reported")

    monkeypatch.setattr(sft, "load_causal_lm", refuse)


def test_unknown_lora_target_fails_before_the_load(tmp_path, no_model_load):
    with pytest.raises(ValueError, match=r"`model.lora.target_modules`: \['qkv'\] matches no linear module"):
        sft.main(["fit", "--config", CONFIG, f"--trainer.default_root_dir={tmp_path}", "--model.lora.target_modules=[q_proj,qkv]"])
