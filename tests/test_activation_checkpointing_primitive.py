import pytest
import torch

from lightning_mem.activation_checkpointing import checkpoint_block, checkpoint_blocks, checkpointed_indices, is_checkpointed
from tests import memtest_utils as h


def test_every_kth_block_from_the_first():
    assert checkpointed_indices(5, 1) == [0, 1, 2, 3, 4]
    assert checkpointed_indices(5, 2) == [0, 2, 4]
    assert checkpointed_indices(5, 0) == []


def test_checkpointing_keeps_the_gradients_and_is_applied_once():
    torch.manual_seed(0)
    plain = h.tiny_llama(seed=0)
    ckpt = h.tiny_llama(seed=0)
    assert checkpoint_blocks(ckpt, every=1) == (len(ckpt.model.layers), len(ckpt.model.layers))
    assert not checkpoint_block(ckpt.model.layers[0])  # already checkpointed: no second wrapper
    assert all(is_checkpointed(b) for b in ckpt.model.layers) and not is_checkpointed(ckpt.model)
    ids = torch.randint(0, plain.config.vocab_size, (2, 12))
    for model in (plain, ckpt):
        model(input_ids=ids, labels=ids).loss.backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), ckpt.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_a_model_without_the_blocks_is_an_error():
    with pytest.raises(ValueError, match=r"has no module of class \['NoSuchBlock'\]"):
        checkpoint_blocks(h.tiny_llama(seed=0), block_classes=["NoSuchBlock"])
