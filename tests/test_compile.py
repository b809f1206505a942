"""Regional compilation (lightning_mem.compile): Inductor on this CPU trains like eager, composes
with activation checkpointing, saves no more for backward, survives a deepcopy, and runs eager
under the estimator's dispatch mode. The first Inductor compile of the tiny block takes about 30 s
on a loaded 2-core machine (later ones hit Inductor's on-disk cache)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_mem.activation_checkpointing import checkpoint_blocks, is_checkpointed
from lightning_mem.compile import MODES, check_compile_settings, compile_block, compile_blocks, is_compiled
from lightning_mem.settings import SettingError
from tests import memtest_utils as h


@pytest.fixture(scope="module")
def compiled_pair():
    """The tiny Llama twice from one seed: eager, and with every block compiled by Inductor and
    blocks 0 and 2 also checkpointed (checkpoint first, then compile: torchtitan's order)."""
    from torch._dynamo.utils import counters

    counters.clear()
    eager, compiled = h.tiny_llama(seed=0), h.tiny_llama(seed=0)
    checkpoint_blocks(compiled, every=2)
    assert compile_blocks(compiled, backend="inductor") == (4, 4)
    assert compiled.config.use_cache is False  # a KV cache in a training forward would specialise each block
    eager.config.use_cache = False
    return eager, compiled, counters


def test_inductor_blocks_train_like_eager_over_three_steps(compiled_pair):
    eager, compiled, counters = compiled_pair
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (eager, compiled)]
    for step, ids in enumerate(h.token_batches(3)):
        losses = []
        for model, optimizer in zip((eager, compiled), optimizers):
            loss = h.lm_loss(model, ids)
            loss.backward()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5, msg=f"loss, step {step}")
        for (name, a), (_, b) in zip(eager.named_parameters(), compiled.named_parameters()):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5, msg=f"{name}, step {step}")
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    # It really compiled: one frame (the block class's forward, shared by all four blocks), no breaks.
    assert counters["frames"]["ok"] >= 1 and counters["stats"]["unique_graphs"] >= 1, dict(counters["frames"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert all(is_compiled(b) for b in compiled.model.layers)
    assert [is_checkpointed(b) for b in compiled.model.layers] == [True, False, True, False]


def test_a_compiled_block_saves_no_more_for_backward_than_eager(compiled_pair):
    eager = h.tiny_llama(seed=0)
    compiled = h.tiny_llama(seed=0)
    compile_blocks(compiled)
    ids = h.token_batches(1)[0]
    eager_bytes, _ = h.saved_activation_bytes(eager, lambda: h.lm_loss(eager, ids).backward())
    compiled_bytes, _ = h.saved_activation_bytes(compiled, lambda: h.lm_loss(compiled, ids).backward())
    assert 0 < compiled_bytes <= eager_bytes, (compiled_bytes, eager_bytes)


class _OpLog(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_under_a_dispatch_mode_compiled_blocks_run_their_eager_ops(compiled_pair):
    eager, compiled, _ = compiled_pair  # the memory estimator's tracker is such a mode
    ids = h.token_batches(1, seed=5)[0]
    logs = []
    for model in (eager, compiled):
        with torch.no_grad(), _OpLog() as log:
            model(input_ids=ids)
        logs.append(log.ops)
    assert logs[1] == logs[0] and logs[0].count("mm") >= 7 * 4  # every projection of every block, as eager


def test_a_deep_copy_runs_on_its_own_weights():
    model = h.tiny_llama(seed=0, layers=2)
    compile_blocks(model, backend="eager")
    assert not compile_block(model.model.layers[0], backend="eager")  # already compiled: left as it is
    twin = copy.deepcopy(model)
    assert twin.model.layers[0].forward.__self__ is twin.model.layers[0]
    with torch.no_grad():
        for p in twin.model.layers[1].parameters():
            p.mul_(0.5)
    ids = h.token_batches(1)[0]
    reference = copy.deepcopy(twin)
    for layer in reference.model.layers:  # the same halved weights, eager
        del layer.forward
    with torch.no_grad():
        torch.testing.assert_close(twin(input_ids=ids).logits, reference(input_ids=ids).logits)
        assert not torch.allclose(twin(input_ids=ids).logits, model(input_ids=ids).logits)


def test_settings_that_cannot_work_are_refused_by_name():
    assert None in MODES and "reduce-overhead" not in MODES
    with pytest.raises(SettingError, match=r"`mode` must be one of .*CUDA-graph"):
        check_compile_settings(mode="reduce-overhead")
    with pytest.raises(SettingError, match=r"`backend` 'inductr' is not a torch.compile backend"):
        check_compile_settings(backend="inductr")
    with pytest.raises(ValueError, match=r"has no module of class \['NoSuchBlock'\] to compile"):
        compile_blocks(h.tiny_llama(seed=0, layers=1), block_classes=["NoSuchBlock"])


def test_inductor_on_a_cpu_needs_a_cpp_compiler(monkeypatch):
    import lightning_mem.compile as compile_module

    monkeypatch.setattr(compile_module.shutil, "which", lambda name: None)
    with pytest.raises(SettingError, match=r"`backend` inductor on a CPU compiles C\+\+"):
        check_compile_settings("inductor", device_type="cpu")
    check_compile_settings("inductor", device_type="cuda")  # Triton on a GPU: no C++ compiler needed
    check_compile_settings("aot_eager", device_type="cpu")


def test_blocks_are_found_by_a_base_class_as_after_fully_shard():
    model = h.tiny_llama(seed=0, layers=2)
    for layer in model.model.layers:  # what FSDP2's fully_shard does to a block's class
        layer.__class__ = type("FSDPLlamaDecoderLayer", (type(layer),), {})
    assert compile_blocks(model, backend="eager") == (2, 2)
    assert all(is_compiled(layer) for layer in model.model.layers)
