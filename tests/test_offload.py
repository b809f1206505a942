"""Optimizer-state and module offload: bit-exact round trips, ledgers, FSDP2 DTensor state."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import bitsandbytes as bnb
import pytest
import torch
from memtest_utils import tiny_llama

from tests.helpers import HANG_GUARD_S
from torch import nn

from lightning_mem.offload import (
    module_location,
    module_offloaded,
    module_residency,
    offload_module,
    offload_optimizer_state,
    optimizer_state_location,
    optimizer_state_residency,
    optimizer_state_to_device,
    optimizer_state_to_host,
    reload_module,
)
from lightning_mem.optim import optimizer_state_bytes

OPTIMIZERS = {
    "AdamW": torch.optim.AdamW,
    "AdamW8bit": bnb.optim.AdamW8bit,
    "PagedAdamW8bit": bnb.optim.PagedAdamW8bit,
    "PagedAdamW32bit": bnb.optim.PagedAdamW32bit,
}


def _random_steps(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=generator)
        optimizer.step()


def _state_tensors(optimizer: torch.optim.Optimizer) -> dict[tuple[int, str], torch.Tensor]:
    return {
        (i, k): v for i, state in enumerate(optimizer.state.values()) for k, v in state.items() if isinstance(v, torch.Tensor)
    }


@pytest.fixture(scope="module")
def trained() -> dict:
    """Each optimizer after two steps on the tiny Llama, plus a twin that never round-trips."""
    out = {}
    with pytest.warns(UserWarning):  # bitsandbytes: paged optimizers fall back on CPU
        for name, cls in OPTIMIZERS.items():
            pair = []
            for _ in range(2):
                model = tiny_llama()
                optimizer = cls(model.parameters(), lr=1e-3)
                _random_steps(model, optimizer, 2, seed=0)
                pair.append((model, optimizer))
            out[name] = pair
    return out


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_round_trip_is_bit_exact_and_the_ledger_says_host(trained: dict, name: str) -> None:
    (model, optimizer), (twin_model, twin_optimizer) = trained[name]
    before = {key: (t.clone(), t.data_ptr(), t.stride()) for key, t in _state_tensors(optimizer).items()}
    total = optimizer_state_bytes(optimizer)
    assert optimizer_state_location(optimizer) == "device"

    with offload_optimizer_state(optimizer) as ledger:
        assert ledger.location == optimizer_state_location(optimizer) == "host"
        inside = _state_tensors(optimizer)
        # On CPU host and device share memory, so "moved" means a fresh host copy of every
        # state tensor: nothing of the device-side state is still referenced.
        assert all(inside[key].data_ptr() != ptr for key, (_, ptr, _) in before.items())
        assert ledger.bytes == total == optimizer_state_bytes(optimizer)
        assert len(ledger.slots) == len(before) + len(getattr(optimizer, "name2qmap", {}))

    after = _state_tensors(optimizer)
    assert optimizer_state_location(optimizer) == "device"
    assert after.keys() == before.keys()
    for key, (value, _, stride) in before.items():
        assert after[key].dtype == value.dtype and after[key].stride() == stride
        assert torch.equal(after[key], value), key
    if isinstance(optimizer, bnb.optim.optimizer.Optimizer8bit) and optimizer.name2qmap:
        # Shared maps stay shared, including the optimizer's own reference.
        first = next(iter(optimizer.state.values()))
        if "qmap1" in first:
            assert all(s["qmap1"] is optimizer.name2qmap["dynamic"] for s in optimizer.state.values() if "qmap1" in s)

    # The next step is the same as the twin's, which never left the device.
    _random_steps(model, optimizer, 1, seed=1)
    _random_steps(twin_model, twin_optimizer, 1, seed=1)
    for p, q in zip(model.parameters(), twin_model.parameters()):
        assert torch.equal(p, q)


def test_offloading_twice_is_refused_and_new_state_is_picked_up() -> None:
    model = nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters())
    ledger = optimizer_state_to_host(optimizer)  # no state yet: nothing to move
    assert ledger.location == "host" and ledger.bytes == 0
    with pytest.raises(RuntimeError, match="already on the host"):
        with offload_optimizer_state(optimizer):
            pass
    optimizer_state_to_device(optimizer)
    _random_steps(model, optimizer, 1, seed=0)  # state appears
    ledger = optimizer_state_to_host(optimizer)
    assert ledger.bytes == optimizer_state_bytes(optimizer) == 2 * 4 * (64 + 8) + 2 * 4
    again = optimizer_state_to_host(optimizer)  # already moved: nothing moves twice
    assert again.bytes == ledger.bytes and len(again.moved) == 6
    optimizer_state_to_device(optimizer)
    assert optimizer_state_residency(optimizer).location == "device"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fsdp2_dtensor_state_round_trip_and_activation_offload(tmp_path: Path) -> None:
    """Two gloo ranks with torch fully_shard: DTensor state round-trips bit-exactly, each rank
    holds 1/world of the state, and activation offload leaves the sharded gradients unchanged."""
    root = Path(__file__).resolve().parents[1]
    world = 2
    env = dict(os.environ, WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               PYTHONPATH=os.pathsep.join([str(root), str(root / "tests")]), OMP_NUM_THREADS="1")
    script = root / "tests" / "fsdp2_offload_worker.py"
    procs = [
        subprocess.Popen([sys.executable, str(script), str(tmp_path / "out")], env=dict(env, RANK=str(r)),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(world)
    ]
    try:
        logs = [p.communicate(timeout=HANG_GUARD_S)[0] for p in procs]
    finally:
        for p in procs:  # a hung rank must not outlive the test
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-4000:]
    results = [json.loads((tmp_path / f"out.{r}.json").read_text()) for r in range(world)]

    for res in results:
        assert res["grads_equal"] == [True, True]
        assert all(b > 0 for b in res["stashed_bytes"])
        assert res["dtensor_state_tensors"] > 0 and res["moved_out"]
        assert res["location_inside"] == "host" and res["location_after"] == "device"
        assert res["ledger_bytes"] == res["state_bytes_inside"] == res["state_bytes"]
        assert res["round_trip_exact"] and res["params_equal"]
        # AdamW on this rank's shards: 8 bytes per local element plus a 4-byte step per tensor.
        assert res["state_bytes"] == 8 * res["local_numel"] + 4 * res["param_tensors"]
        assert "DTensor" in res["move_module_error"]
    assert sum(r["local_numel"] for r in results) == results[0]["global_numel"]


# -- modules -----------------------------------------------------------------------------------
def test_module_round_trip_keeps_parameters_and_is_bit_exact() -> None:
    model = tiny_llama()
    model.requires_grad_(False)  # a frozen reference model
    params_before = {n: (p, p.detach().clone(), p.data_ptr()) for n, p in model.named_parameters()}
    buffers_before = {n: b.clone() for n, b in model.named_buffers()}
    expected_bytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    (ids,) = [torch.randint(0, 512, (1, 16))]
    logits = model(input_ids=ids).logits

    with module_offloaded(model) as ledger:
        assert module_location(model) == "host" and ledger.bytes == expected_bytes
        assert ledger.tensors == len(params_before) + len(buffers_before)
        for name, param in model.named_parameters():
            original, _, ptr = params_before[name]
            assert param is original and param.data_ptr() != ptr  # same Parameter, fresh storage
    assert module_location(model) == "device"
    for name, param in model.named_parameters():
        assert torch.equal(param, params_before[name][1])
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, buffers_before[name])
    assert torch.equal(model(input_ids=ids).logits, logits)

    assert offload_module(model) is offload_module(model) is module_residency(model)  # idempotent
    reload_module(model)
    assert module_location(model) == "device"


# -- CUDA ----------------------------------------------------------------------------------------
def _unique_cuda_bytes(tensors) -> int:
    unique = {t.data_ptr(): t.numel() * t.element_size() for t in tensors if t.is_cuda}
    return sum(unique.values())


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["AdamW", "AdamW8bit"])
def test_cuda_offload_frees_the_state_bytes_on_device(name: str) -> None:
    model = tiny_llama().cuda()
    optimizer = OPTIMIZERS[name](model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    model.zero_grad(set_to_none=True)
    before = {k: v.to("cpu", copy=True) for k, v in _state_tensors(optimizer).items()}
    homes = {k: v.device for k, v in _state_tensors(optimizer).items()}
    state_on_device = _unique_cuda_bytes(
        [*_state_tensors(optimizer).values(), *getattr(optimizer, "name2qmap", {}).values()]
    )
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    with offload_optimizer_state(optimizer) as ledger:
        assert ledger.bytes == state_on_device > 0
        assert all(not t.is_cuda for t in _state_tensors(optimizer).values())
        assert all(t.is_pinned() for t in _state_tensors(optimizer).values() if t.dim() > 0)
        # The allocator rounds blocks up, so at least the exact bytes were freed.
        assert allocated - torch.cuda.memory_allocated() >= state_on_device
    assert torch.cuda.memory_allocated() == allocated
    for key, value in _state_tensors(optimizer).items():
        assert value.device == homes[key] and torch.equal(value.cpu(), before[key])
    # AdamW keeps its scalar step on the CPU next to CUDA parameters: it never moved.
    if name == "AdamW":
        assert all(s["step"].device.type == "cpu" for s in optimizer.state.values())


@pytest.mark.gpu
def test_cuda_module_offload_frees_and_restores_the_weights() -> None:
    model = tiny_llama().cuda().requires_grad_(False)
    weights = {n: p.to("cpu", copy=True) for n, p in model.named_parameters()}
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    with module_offloaded(model) as ledger:
        assert all(p.device.type == "cpu" and p.is_pinned() for p in model.parameters())
        assert allocated - torch.cuda.memory_allocated() >= ledger.bytes > 0
    assert all(p.is_cuda and torch.equal(p.cpu(), weights[n]) for n, p in model.named_parameters())


def _cannot_page_reason() -> str | None:
    """Why the paged GPU tests skip here, or None: they ask the platform first."""
    from lightning_mem import paging

    if not torch.cuda.is_available():
        return "no CUDA device"
    if not paging.paging_supported("cuda:0"):
        return paging.no_paging_reason("cuda:0")
    free, _ = torch.cuda.mem_get_info()
    if free < 256 * 2**20:  # managed memory beyond what the card has free can hang the GPU
        return f"cuda:0 has {free} bytes free, under the 256 MiB this test keeps in reserve"
    return None


@pytest.mark.gpu
def test_cuda_paged_state_is_prefetched_to_the_host_and_back_in_place() -> None:
    reason = _cannot_page_reason()
    if reason:
        pytest.skip(f"paged state cannot page here: {reason}")
    torch.manual_seed(0)
    # 1024 x 1024 > 1e5 elements: bitsandbytes pages this state (2 MiB of uint8 managed memory).
    model, reference = nn.Linear(1024, 1024).cuda(), nn.Linear(1024, 1024).cuda()
    reference.load_state_dict(model.state_dict())
    optimizer = bnb.optim.PagedAdamW8bit(model.parameters(), lr=1e-3)
    unpaged = bnb.optim.AdamW8bit(reference.parameters(), lr=1e-3)
    grads = [[torch.randn_like(p) for p in model.parameters()] for _ in range(2)]

    def step(m: nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
        for p, g in zip(m.parameters(), grads[i]):
            p.grad = g.clone()
        opt.step()

    step(model, optimizer, 0)
    step(reference, unpaged, 0)
    state1 = optimizer.state[model.weight]["state1"]
    assert getattr(state1, "is_paged", False)
    value = state1.clone()
    with offload_optimizer_state(optimizer) as ledger:
        assert [t.paged for t in ledger.moved if "state[0].state1" in t.slots] == [True]
        assert optimizer.state[model.weight]["state1"] is state1  # same buffer, its pages on the host
        assert torch.equal(state1, value)  # the host reads it where it is
    assert torch.equal(optimizer.state[model.weight]["state1"], value)
    step(model, optimizer, 1)  # the step after the round trip is the unpaged optimizer's
    step(reference, unpaged, 1)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)


@pytest.mark.gpu
def test_cuda_paging_decision_follows_the_platform() -> None:
    from lightning_mem import paging
    from lightning_mem.optim import page_where_supported

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    optimizer = bnb.optim.PagedAdamW8bit(nn.Linear(8, 8).cuda().parameters())  # no state yet: no managed memory
    can_page = paging.concurrent_managed_access("cuda:0")
    assert page_where_supported(optimizer) is can_page and optimizer.is_paged is can_page


# -- paged state on CPU, the platform query replaced: which path the offload takes -----------------
def _optimizer_with_paged_state() -> tuple[torch.optim.Optimizer, torch.Tensor]:
    """An optimizer holding a buffer that carries bitsandbytes' paged marks (bitsandbytes makes
    none on CPU, so the marks are set by hand; the runtime call is replaced in the tests)."""
    model = nn.Linear(16, 16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    paged = torch.arange(256, dtype=torch.float32).view(16, 16)
    paged.is_paged, paged.page_deviceid = True, 0
    optimizer.state[model.weight]["state1"] = paged
    optimizer.state[model.bias]["momentum_buffer"] = torch.ones(16)
    return optimizer, paged


def test_paged_state_is_prefetched_in_place_where_the_platform_pages(monkeypatch) -> None:
    from lightning_mem import paging

    calls = []
    monkeypatch.setattr(paging, "paging_query", lambda device: True)
    monkeypatch.setattr(paging, "_runtime_prefetch", lambda *call: calls.append(call))  # (pointer, bytes, GPU, to host)
    optimizer, paged = _optimizer_with_paged_state()
    with offload_optimizer_state(optimizer) as ledger:
        assert calls == [(paged.data_ptr(), 1024, torch.device("cuda", 0), True)]  # to the host, on its GPU's stream
        [moved] = [t for t in ledger.moved if t.paged]
        assert moved.slots == ("state[0].state1",) and moved.nbytes == 1024 and moved.device == torch.device("cuda", 0)
        assert optimizer.state[optimizer.param_groups[0]["params"][0]]["state1"] is paged  # in place, not copied
        assert ledger.bytes == 1024 + 64
    assert calls[1:] == [(paged.data_ptr(), 1024, torch.device("cuda", 0), False)]  # back to its GPU
    assert optimizer.state[optimizer.param_groups[0]["params"][0]]["state1"] is paged


def test_paged_state_stays_with_the_driver_where_the_platform_cannot_page(monkeypatch) -> None:
    from lightning_mem import offload, paging

    offload._warning_cache.clear()
    monkeypatch.setattr(paging, "paging_query", lambda device: False)
    monkeypatch.setattr(paging, "_runtime_prefetch", lambda *args: pytest.fail("no prefetch where the GPU cannot page"))
    optimizer, paged = _optimizer_with_paged_state()
    with pytest.warns(UserWarning, match=r"SGD's paged state stays where the driver keeps it: cuda:0 has no concurrent"):
        with offload_optimizer_state(optimizer) as ledger:
            assert [t.slots for t in ledger.moved] == [("state[1].momentum_buffer",)]  # the rest still moves
            assert ledger.bytes == 64  # nothing of the paged buffer counts as offloaded
            assert optimizer.state[optimizer.param_groups[0]["params"][0]]["state1"] is paged
    assert torch.equal(paged, torch.arange(256, dtype=torch.float32).view(16, 16))


def test_optimizer_state_onto_moves_state_but_not_the_step_counters():
    from lightning_mem.offload import optimizer_state_onto

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    meta = torch.device("meta")  # another device than the CPU the state was made on
    optimizer_state_onto(opt, meta)
    for state in opt.state.values():
        assert state["exp_avg"].device == meta and state["exp_avg_sq"].device == meta
        assert state["step"].device.type == "cpu"  # torch steps the counter on the CPU


def test_a_failing_prefetch_leaves_the_paged_state_with_the_driver_and_says_why(monkeypatch) -> None:
    from lightning_mem import offload, paging

    def failing(*call):
        raise RuntimeError("cudaMemPrefetchAsync(to the host) failed: invalid argument (cudaError 1)")

    offload._warning_cache.clear()
    monkeypatch.setattr(paging, "paging_query", lambda device: True)
    monkeypatch.setattr(paging, "_runtime_prefetch", failing)
    optimizer, paged = _optimizer_with_paged_state()
    with pytest.warns(UserWarning, match=r"SGD's paged state stays where the driver keeps it: cudaMemPrefetchAsync"):
        with offload_optimizer_state(optimizer) as ledger:
            assert ledger.bytes == 64 and optimizer.state[optimizer.param_groups[0]["params"][0]]["state1"] is paged
    assert optimizer_state_location(optimizer) == "device"
