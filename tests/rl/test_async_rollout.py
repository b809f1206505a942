"""The pieces of separate placement without a model: the staleness settings and their rule, the
look-ahead of the prompt sampler, and the rollout link (messages round trip, a request's number
carries its group size and greedy flag; a dead or silent peer is one line, in time)."""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_mem.batching import TokenBudgetSampler
from lightning_mem.rl import rollout_link as rl
from lightning_mem.rl.async_config import AsyncRolloutConfig
from lightning_mem.rl.engine_config import RolloutEngineConfig
from lightning_mem.settings import SettingError


def test_admission_and_lateness_follow_max_staleness():
    cfg = AsyncRolloutConfig(max_staleness=2)
    assert [cfg.admits(request=5, held_version=v) for v in (2, 3, 4, 5)] == [False, True, True, True]
    assert [cfg.late(sampled_version=v, trained_at=5) for v in (2, 3, 5)] == [True, False, False]
    sync = AsyncRolloutConfig(max_staleness=0)
    assert sync.admits(request=3, held_version=3) and not sync.admits(request=3, held_version=2)


def test_a_sync_rarer_than_the_bound_allows_is_refused_naming_both_keys():
    with pytest.raises(SettingError, match=r"^`weight_sync_steps`=2 with `max_staleness`=0: .* use at most `max_staleness` \+ 1 = 1"):
        AsyncRolloutConfig(max_staleness=0, weight_sync_steps=2)
    AsyncRolloutConfig(max_staleness=1, weight_sync_steps=2)  # syncs every other step: admissible
    with pytest.raises(SettingError, match=r"^`max_staleness`"):
        AsyncRolloutConfig(max_staleness=-1)
    with pytest.raises(SettingError, match=r"^`timeout_s`"):
        AsyncRolloutConfig(timeout_s=0)


def test_separate_placement_runs_either_engine_on_one_device_per_generator():
    from lightning_mem.rl.engine_config import engines_stood_in

    RolloutEngineConfig(placement="separate").validate()
    with engines_stood_in():  # vLLM may be missing here; its install is checked apart
        RolloutEngineConfig(name="vllm", placement="separate").validate()
    with pytest.raises(SettingError, match=r"^`rollout_engine.tensor_parallel_size`=2 with `rollout_engine.placement:"
                                           r" separate`: each generator holds its copy on one device"):
        RolloutEngineConfig(name="vllm", placement="separate", tensor_parallel_size=2).validate()


def test_a_requests_number_carries_its_group_size_and_the_greedy_flag():
    for group_size in (1, 4, 1024):
        for greedy in (False, True):
            assert rl.read_request_number(rl.request_number(group_size, greedy)) == (group_size, greedy)
    assert rl.request_number(4, False) == 4  # without the flag, the group size as before


@pytest.mark.parametrize("replicas", [1, 2])
def test_sampler_look_ahead_is_what_the_loader_yields_over_epochs_and_after_a_resume(replicas):
    lengths = list(range(3, 43))
    for rank in range(replicas):
        sampler = TokenBudgetSampler(lengths, batch_size=4, num_replicas=replicas, rank=rank, seed=7)
        yielded = []
        for epoch in range(3):
            sampler.set_epoch(epoch)
            yielded += [list(b) for b in sampler]
        assert [list(sampler.batch_at(n)) for n in range(len(yielded))] == yielded
        resumed = TokenBudgetSampler(lengths, batch_size=4, num_replicas=replicas, rank=rank, seed=7)
        resumed.position_fn = lambda: 7  # Lightning's count of batches run
        assert [list(b) for b in resumed][:3] == [list(resumed.batch_at(n)) for n in (7, 8, 9)]


# -- the link, between this process and a spawned peer --------------------------------------------------

def _peer(port: int, mode: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=datetime.timedelta(seconds=60))
    group = rl.open_group(store, 1, 2, 60)
    link = rl.Link(group, 0, 60, lambda: "the test's trainer")
    kind, a, b, tensors = link.recv(tag=rl.CONTROL, what="test")
    if mode == "echo":
        link.send(kind, a + 1, b + 1, [t * 2 if t.is_floating_point() else t for t in tensors], tag=rl.SAMPLES, what="test")
        link.recv(tag=rl.CONTROL, what="test")
    elif mode == "die":
        import os

        os._exit(3)
    else:  # hang: never answer
        time.sleep(120)


def _link(mode: str, timeout_s: float) -> tuple[rl.Link, object]:
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    peer = mp.get_context("spawn").Process(target=_peer, args=(store.port, mode), daemon=True)
    peer.start()
    group = rl.open_group(store, 0, 2, 60)
    link = rl.Link(group, 1, timeout_s, lambda: f"the test's peer (pid {peer.pid})")
    link._store = store
    return link, peer


def test_link_round_trips_tensors_of_any_dtype_and_shape():
    link, peer = _link("echo", 60)
    sent = [torch.randn(3, 5), torch.arange(7), torch.zeros(0, 4, dtype=torch.bfloat16), torch.tensor(2.5, dtype=torch.float64),
            torch.ones(2, 2, 2, dtype=torch.uint8)]
    link.send(rl.REQUEST, 10, 20, sent, tag=rl.CONTROL, what="test")
    kind, a, b, got = link.recv(tag=rl.SAMPLES, what="test")
    assert (kind, a, b) == (rl.REQUEST, 11, 21)
    for s, g in zip(sent, got):
        assert g.dtype == s.dtype and g.shape == s.shape
        assert torch.equal(g, s * 2 if s.is_floating_point() else s)
    link.send(rl.STOP, 0, 0, [], tag=rl.CONTROL, what="test")
    peer.join(30)


@pytest.mark.parametrize("mode", ["die", "hang"])
def test_a_dead_or_silent_peer_is_one_line_within_the_timeout(mode):
    timeout = 5.0
    link, peer = _link(mode, timeout)
    link.send(rl.REQUEST, 0, 0, [torch.ones(1)], tag=rl.CONTROL, what="test")
    start = time.monotonic()
    with pytest.raises(rl.LinkLost) as err:
        link.recv(tag=rl.SAMPLES, what="waiting for an answer")
    took = time.monotonic() - start
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"the test's peer (pid {peer.pid}) failed while waiting for an answer: ")
    assert ("timed out" if mode == "hang" else "connection lost") in message
    assert took < timeout + 5
    peer.kill()
    peer.join(10)
