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


# ---------------------------------------------------------------- selective, input offload, first n blocks


def _live_bytes(created) -> int:
    # A live storage seen twice (an op returning its input, a view) counts once.
    live = {ref.cdata: n for ref, n in created if not ref.expired()}
    return sum(live.values())


def held_for_backward(model, ids) -> tuple[int, torch.Tensor]:
    """Bytes of every storage the forward created that is still alive when it returns (what the
    graph keeps for backward, plus the logits and loss), whoever keeps it: autograd's saved
    tensors, selective checkpointing's own cache, an offloader's host copies."""
    import gc

    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    # Every storage made, not keyed by address: a freed one's address is reused by later ones.
    created: list[tuple[StorageWeakRef, int]] = []

    class Created(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    storage = t.untyped_storage()
                    created.append((StorageWeakRef(storage), storage.nbytes()))
            return out

    with Created():
        loss = model(input_ids=ids, labels=ids).loss
    gc.collect()
    return _live_bytes(created), loss


def grads_and_held(configure) -> tuple[int, dict[str, torch.Tensor]]:
    model = h.tiny_llama(seed=0)
    configure(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    held, loss = held_for_backward(model, ids)
    loss.backward()
    return held, model, {n: p.grad for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def none_and_full():
    return grads_and_held(lambda m: None), grads_and_held(lambda m: checkpoint_blocks(m, every=1))


def test_selective_keeps_the_gradients_and_holds_between_none_and_every_block(none_and_full):
    (none_bytes, _, none_grads), (full_bytes, _, _) = none_and_full
    sel_bytes, model, sel_grads = grads_and_held(lambda m: checkpoint_blocks(m, every=1, policy="selective"))
    assert all(is_checkpointed(b) for b in model.model.layers)
    assert full_bytes < sel_bytes < none_bytes, (full_bytes, sel_bytes, none_bytes)
    for name, grad in none_grads.items():
        torch.testing.assert_close(sel_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_the_first_n_blocks_hold_between_none_and_every_block(none_and_full):
    (none_bytes, _, none_grads), (full_bytes, _, _) = none_and_full
    two_bytes, model, two_grads = grads_and_held(lambda m: checkpoint_blocks(m, count=2))
    assert [is_checkpointed(b) for b in model.model.layers] == [True, True, False, False]
    assert full_bytes < two_bytes < none_bytes
    # Blocks are alike: two of four checkpointed saves half of what all four save.
    assert abs((none_bytes - two_bytes) - (none_bytes - full_bytes) / 2) <= 0.05 * (none_bytes - full_bytes)
    for name, grad in none_grads.items():
        torch.testing.assert_close(two_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_offloaded_inputs_are_exactly_the_checkpointed_blocks_inputs(none_and_full):
    (_, _, none_grads), _ = none_and_full
    model = h.tiny_llama(seed=0)
    checkpoint_blocks(model, count=3, offload_inputs=True)
    offloader = model._lightning_mem_input_offloader
    ids = torch.randint(0, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    hidden = 2 * 64 * model.config.hidden_size * 4  # one fp32 hidden state per checkpointed block
    assert (offloader.stats.stashed_tensors, offloader.stats.stashed_bytes) == (3, 3 * hidden)
    assert not offloader.active
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, none_grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_an_unknown_policy_is_named():
    with pytest.raises(ValueError, match="policy must be one of"):
        checkpoint_blocks(h.tiny_llama(seed=0), policy="some")
