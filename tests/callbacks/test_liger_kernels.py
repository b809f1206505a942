"""The LigerKernels callback: on a CPU it stops the run in setup, before the model loads, naming
itself; the estimate leaves it out and says so; what Liger rebinds for the whole process is put back
when fit ends; on CUDA (marked gpu) Liger's RMSNorm, SwiGLU and RoPE train the tiny Llama like its
own modules."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_mem.callbacks import LigerKernels
from lightning_mem.settings import SettingError
from tests.helpers import REPO

CONFIG = str(REPO / "configs" / "sft" / "tiny_cpu.yaml")
LIGER = {"class_path": "lightning_mem.callbacks.LigerKernels"}


def test_on_a_cpu_the_run_stops_before_the_model_loads(tmp_path):
    from lightning.pytorch import Trainer

    from recipes.sft import SFTModule

    module = SFTModule(str(REPO / "assets/tiny-llama"), export_dir=None)
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, callbacks=[LigerKernels()], default_root_dir=str(tmp_path))
    with pytest.raises(SettingError, match=r"^`trainer.callbacks\[LigerKernels\]`: Liger's kernels are Triton kernels"
                                           r" and need a CUDA device; this run's device is cpu; remove the callback"):
        trainer.fit(module, train_dataloaders=[{"input_ids": torch.ones(1, 4, dtype=torch.long)}])
    assert module.model is None


def test_a_kernel_name_it_does_not_know_is_an_error():
    from lightning_mem.liger import KERNELS, liger_settings

    assert liger_settings(rope=False) == {"rms_norm": True, "swiglu": True, "rope": False}
    assert set(KERNELS) == {"rms_norm", "swiglu", "rope"}  # no loss kernel: the recipes' loss is lightning_mem.logits
    with pytest.raises(ValueError, match=r"unknown Liger kernels \['fused_linear_cross_entropy'\]"):
        liger_settings(fused_linear_cross_entropy=True)


def test_the_estimate_leaves_liger_out_and_says_so(tmp_path):
    from lightning_mem.estimate import estimate
    from lightning_mem.estimate.measure import filling_rows

    rows = filling_rows(tmp_path)["sft"]
    plain = estimate(CONFIG, [*rows, "--trainer.callbacks=[]"])
    liger = estimate(CONFIG, [*rows, f"--trainer.callbacks={json.dumps([LIGER])}"])  # no CUDA here: not run
    assert liger.device_peak_bytes == plain.device_peak_bytes
    assert any(note.startswith("LigerKernels: estimated with the model's own modules") for note in liger.notes)


def test_the_names_a_call_rebinds_in_transformers_modules_are_recorded_and_put_back():
    from transformers.models.llama import modeling_llama

    from lightning_mem.liger import record_module_patches, undo_module_patches

    rope, norm = modeling_llama.apply_rotary_pos_emb, modeling_llama.LlamaRMSNorm

    def patch() -> str:  # what Liger's apply_liger_kernel_to_llama does to the module
        modeling_llama.apply_rotary_pos_emb = lambda *args: args
        modeling_llama.LlamaRMSNorm = type("OtherNorm", (torch.nn.Module,), {})
        modeling_llama.added_by_the_call = 1  # added, not rebound: left (lazy packages gain names on import)
        return "applied"

    try:
        result, patches = record_module_patches(patch)
        assert result == "applied"
        assert sorted((module.__name__, name) for module, name, _ in patches) == [
            ("transformers.models.llama.modeling_llama", "LlamaRMSNorm"),
            ("transformers.models.llama.modeling_llama", "apply_rotary_pos_emb")]
        assert undo_module_patches(patches) == 2
        assert modeling_llama.apply_rotary_pos_emb is rope and modeling_llama.LlamaRMSNorm is norm
    finally:
        modeling_llama.apply_rotary_pos_emb, modeling_llama.LlamaRMSNorm = rope, norm
        vars(modeling_llama).pop("added_by_the_call", None)


def test_the_callback_puts_back_what_liger_rebound_for_the_process_when_fit_ends(monkeypatch):
    # Liger itself needs CUDA; its effect on the modeling module is what the callback undoes.
    from transformers.models.llama import modeling_llama

    from lightning_mem.callbacks import liger_kernels
    from tests import memtest_utils as h

    rope = modeling_llama.apply_rotary_pos_emb
    applied = []

    def fake_apply(model, **kernels):
        modeling_llama.apply_rotary_pos_emb = lambda *args: args
        applied.append((type(model).__name__, kernels))
        return kernels

    monkeypatch.setattr(liger_kernels, "apply_liger_kernels", fake_apply)
    module = torch.nn.Module()
    module.model = h.tiny_llama(layers=1)
    callback = LigerKernels(rope=True, swiglu=False)
    try:
        callback.on_fit_start(None, module)
        assert applied == [("LlamaForCausalLM", {"rms_norm": True, "swiglu": False, "rope": True})]
        assert modeling_llama.apply_rotary_pos_emb is not rope  # on while fit runs
        callback.teardown(None, module, "validate")
        assert modeling_llama.apply_rotary_pos_emb is not rope  # not another stage's end
        callback.teardown(None, module, "fit")
        assert modeling_llama.apply_rotary_pos_emb is rope
    finally:
        modeling_llama.apply_rotary_pos_emb = rope


@pytest.mark.gpu
def test_liger_kernels_train_like_the_models_own_modules():
    from lightning_mem.liger import apply_liger_kernels
    from tests import memtest_utils as h

    plain, liger = h.tiny_llama(seed=0).cuda(), h.tiny_llama(seed=0).cuda()
    assert apply_liger_kernels(liger) == {"rms_norm": True, "swiglu": True, "rope": True}
    assert type(liger.model.layers[0].mlp.forward.__self__).__name__ == "LlamaMLP"  # the instance, patched
    assert liger.model.layers[0].mlp.forward.__func__ is not type(plain.model.layers[0].mlp).forward
    ids = h.token_batches(1)[0].cuda()
    for model in (plain, liger):
        model.config.use_cache = False
        h.lm_loss(model, ids).backward()
    torch.testing.assert_close(h.lm_loss(liger, ids), h.lm_loss(plain, ids), rtol=1e-4, atol=1e-4)
    for (name, a), (_, b) in zip(plain.named_parameters(), liger.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-3, atol=1e-4, msg=name)
