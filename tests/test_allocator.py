"""The allocator module: which malloc the process runs on, the one-line advice under host offload,
malloc_trim handing freed heap pages back, and when a recipe may turn on expandable segments."""

import os

import pytest
import torch

from lightning_mem import allocator
from lightning_mem.allocator import (
    allocator_advice,
    apply_expandable_segments,
    expandable_segments_decision,
    host_allocator,
    host_offloads,
    release_free_host_memory,
)


def rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize(
    "mapped, expected",
    [
        ("7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libjemalloc.so.2\n", "jemalloc"),
        ("7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4\n", "tcmalloc"),
        ("7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n", "glibc"),
    ],
)
def test_host_allocator_reads_what_the_process_mapped(tmp_path, mapped, expected):
    maps = tmp_path / "maps"
    maps.write_text(mapped)
    assert host_allocator(maps) == expected
    assert host_allocator(tmp_path / "absent") == "unknown"


def test_advice_only_for_host_offload_on_glibc():
    line = allocator_advice(["model.memory_plan.rollout.actor_optimizer"], allocator="glibc")
    assert "model.memory_plan.rollout.actor_optimizer" in line and "LD_PRELOAD=" in line and "\n" not in line
    assert allocator_advice([], allocator="glibc") is None
    assert allocator_advice(["strategy.cpu_offload"], allocator="jemalloc") is None


@pytest.mark.skipif(host_allocator() != "glibc", reason="malloc_trim is glibc's")
def test_malloc_trim_returns_freed_heap_holes():
    # Freeing a mmapped chunk raises glibc's mmap threshold past 2 MiB, so the next buffers come
    # from the heap; freeing every other one leaves holes that free() keeps resident.
    big = torch.ones(8 * 2**20 // 4)
    del big
    held = [torch.ones(2 * 2**20 // 4) for _ in range(32)]
    del held[::2]
    before = rss_bytes()
    assert release_free_host_memory()
    assert before - rss_bytes() >= 24 * 2**20  # most of the 16 freed 2 MiB holes
    assert all(float(t[0]) == 1.0 for t in held)  # what is alive is untouched


def test_release_is_a_no_op_off_glibc(monkeypatch):
    monkeypatch.setattr(allocator, "host_allocator", lambda: "jemalloc")
    assert release_free_host_memory() is False


def test_expandable_segments_decision():
    on = expandable_segments_decision(vllm_sleep=False, current="", cuda=True)
    assert on.set and on.value == "expandable_segments:True"
    assert not expandable_segments_decision(vllm_sleep=True, current="", cuda=True).set
    assert "vLLM" in expandable_segments_decision(vllm_sleep=True, current="", cuda=True).reason
    kept = expandable_segments_decision(vllm_sleep=False, current="max_split_size_mb:128", cuda=True)
    assert not kept.set and kept.value == "max_split_size_mb:128"
    assert not expandable_segments_decision(vllm_sleep=False, current="", cuda=False).set


def test_apply_sets_the_environment_only_when_decided(monkeypatch):
    monkeypatch.delenv(allocator.ALLOC_CONF, raising=False)
    assert not apply_expandable_segments(expandable_segments_decision(vllm_sleep=True, current="", cuda=True))
    assert allocator.ALLOC_CONF not in os.environ
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        assert apply_expandable_segments(expandable_segments_decision(vllm_sleep=False, current="", cuda=True))
        assert os.environ[allocator.ALLOC_CONF] == "expandable_segments:True"


def test_host_offloads_are_read_from_the_built_run():
    from types import SimpleNamespace

    from lightning_mem.callbacks import ActivationOffload, MemoryMonitor, OptimizerStateOffload
    from lightning_mem.rl.memory_plan import PhaseMemoryPlan, PhasePlacement
    from lightning_mem.strategies.zero_config import zero_tier

    plain = SimpleNamespace(strategy=SimpleNamespace(), callbacks=[MemoryMonitor()])
    assert host_offloads(plain, SimpleNamespace()) == []
    fsdp = SimpleNamespace(strategy=SimpleNamespace(cpu_offload=True), callbacks=[ActivationOffload(), OptimizerStateOffload()])
    assert host_offloads(fsdp) == ["strategy.cpu_offload", "ActivationOffload", "OptimizerStateOffload"]
    zero = SimpleNamespace(strategy=SimpleNamespace(tier=zero_tier("zero3_offload")), callbacks=[])
    assert host_offloads(zero) == ["strategy.offload_optimizer", "strategy.offload_params"]
    ppo = SimpleNamespace(memory_plan=PhaseMemoryPlan(rollout=PhasePlacement(actor_optimizer="host")))
    assert host_offloads(SimpleNamespace(strategy=None, callbacks=[]), ppo) == ["model.memory_plan.rollout.actor_optimizer"]
    advice = allocator_advice(host_offloads(fsdp) + ["x", "y"], allocator="glibc")
    assert "strategy.cpu_offload, ActivationOffload, OptimizerStateOffload and 2 more" in advice


@pytest.mark.parametrize("engine, sleep, expected", [("vllm", 1, None), ("vllm", 0, "expandable_segments:True"),
                                                     ("hf", 1, "expandable_segments:True")])
def test_the_cli_turns_on_expandable_segments_except_under_vllm_sleep(monkeypatch, engine, sleep, expected):
    from jsonargparse import Namespace

    from lightning_mem import cli

    monkeypatch.delenv(allocator.ALLOC_CONF, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    cli._set_device_allocator(Namespace(model=Namespace(rollout_engine=Namespace(name=engine, sleep_level=sleep))))
    assert os.environ.get(allocator.ALLOC_CONF) == expected
