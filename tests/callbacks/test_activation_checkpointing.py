import pytest
import torch
from memtest_utils import TinyLM, fit, lm_loss, saved_activation_bytes, token_batches

from lightning_mem.callbacks import ActivationCheckpointing


def _grads_after_fit(tmp_path, callbacks):
    torch.manual_seed(0)
    module = TinyLM()
    fit(module, tmp_path, steps=2, callbacks=callbacks)
    ids = token_batches(1)[0]
    module.model.zero_grad()
    saved = saved_activation_bytes(module.model, lambda: lm_loss(module.model, ids).backward())[0]
    grads = {n: p.grad.clone() for n, p in module.model.named_parameters()}
    return module, saved, grads


def test_same_gradients_and_at_least_3x_fewer_saved_bytes(tmp_path):
    _, plain_saved, plain_grads = _grads_after_fit(tmp_path / "plain", [])
    callback = ActivationCheckpointing()
    _, ckpt_saved, ckpt_grads = _grads_after_fit(tmp_path / "ckpt", [callback])
    assert callback.checkpointed == {"model": 4}
    assert plain_grads.keys() == ckpt_grads.keys()
    for name in plain_grads:
        assert torch.equal(plain_grads[name], ckpt_grads[name]), name
    assert plain_saved >= 3 * ckpt_saved, (plain_saved, ckpt_saved)


def test_every_second_block(tmp_path):
    callback = ActivationCheckpointing(every=2)
    fit(TinyLM(), tmp_path, steps=1, callbacks=[callback])
    assert callback.checkpointed == {"model": 2}


def test_unknown_block_class_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"has no module of class \['NoSuchBlock'\]"):
        fit(TinyLM(), tmp_path, steps=1, callbacks=[ActivationCheckpointing(block_classes=["NoSuchBlock"])])


def test_every_must_be_positive():
    with pytest.raises(ValueError, match="`every` must be >= 1"):
        ActivationCheckpointing(every=0)
