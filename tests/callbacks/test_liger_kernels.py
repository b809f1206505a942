"""The LigerKernels callback: on a CPU it stops the run in setup, before the model loads, naming
itself; the estimate leaves it out and says so; on CUDA (marked gpu) Liger's RMSNorm, SwiGLU and
RoPE train the tiny Llama like its own modules."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_mem.callbacks import LigerKernels
from tests.helpers import REPO

CONFIG = str(REPO / "configs" / "sft" / "tiny_cpu.yaml")
LIGER = {"class_path": "lightning_mem.callbacks.LigerKernels"}


def test_on_a_cpu_the_run_stops_before_the_model_loads(tmp_path):
    from lightning.pytorch import Trainer

    from recipes.sft import SFTModule

    module = SFTModule(str(REPO / "assets/tiny-llama"), export_dir=None)
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, callbacks=[LigerKernels()], default_root_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"LigerKernels \(`trainer.callbacks`\): Liger's kernels are Triton kernels"
                                         r" and need a CUDA device; this run's device is cpu"):
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
