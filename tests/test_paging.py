"""lightning_mem.paging on a CPU-only machine: the CUDA runtime replaced by a recorder, so the calls
and their arguments (the ABI each runtime version takes) are checked; the real calls run in
tests/test_offload.py's GPU tests."""

from __future__ import annotations

import ctypes

import pytest
import torch

from lightning_mem import paging


class FakeRuntime:
    """Answers like libcudart: status 0, the attribute's value written through the pointer."""

    def __init__(self, version: int, concurrent: int = 1) -> None:
        self.version, self.concurrent, self.calls = version, concurrent, []

    def cudaRuntimeGetVersion(self, out) -> int:
        out._obj.value = self.version
        return 0

    def cudaDeviceGetAttribute(self, out, attribute: int, device: int) -> int:
        self.calls.append(("attribute", attribute, device))
        out._obj.value = self.concurrent
        return 0

    def cudaMemPrefetchAsync(self, *args) -> int:
        pointer, nbytes, *target, stream = args
        if isinstance(target[0], ctypes.Structure):  # CUDA 13: a location and flags
            target = [(target[0].type, target[0].id), target[1].value]
        else:  # CUDA 12: a device ordinal, cudaCpuDeviceId for the host
            target = [target[0].value]
        self.calls.append(("prefetch", pointer.value, nbytes.value, *target, stream.value))
        return 0


class _Stream:
    cuda_stream = 1234


@pytest.fixture
def runtime(monkeypatch):
    def install(version: int, concurrent: int = 1) -> FakeRuntime:
        fake = FakeRuntime(version, concurrent)
        paging._runtime_version.cache_clear()
        monkeypatch.setattr(paging, "_runtime", lambda: fake)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "init", lambda: None)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
        return fake

    yield install
    paging._runtime_version.cache_clear()


def _paged(device_id: int) -> torch.Tensor:
    tensor = torch.zeros(1000, dtype=torch.uint8)
    tensor.is_paged, tensor.page_deviceid = True, device_id  # bitsandbytes' marks
    return tensor


@pytest.mark.parametrize("concurrent", [0, 1])
def test_the_platform_query_asks_for_concurrent_managed_access(runtime, concurrent: int) -> None:
    fake = runtime(13000, concurrent)
    assert paging.concurrent_managed_access("cuda:1") is bool(concurrent)
    assert fake.calls == [("attribute", 89, 1)]  # cudaDevAttrConcurrentManagedAccess, on that ordinal
    assert paging.concurrent_managed_access("cpu") is False and len(fake.calls) == 1  # a CPU asks nothing


@pytest.mark.parametrize(
    ("version", "host", "device"),
    [(13000, (2, 0), (1, 1)), (12080, -1, 1)],  # a host/device location and flags 0 / cudaCpuDeviceId, an ordinal
    ids=["cuda13", "cuda12"],
)
def test_prefetch_passes_each_runtime_its_own_destination(runtime, version: int, host, device) -> None:
    fake = runtime(version)
    tensor = _paged(1)
    assert paging.prefetch_paged(tensor, to_host=True) is True
    assert paging.prefetch_paged(tensor, to_host=False) is True
    flags = [0] if version >= 13000 else []
    assert [c for c in fake.calls if c[0] == "prefetch"] == [
        ("prefetch", tensor.data_ptr(), 1000, host, *flags, 1234),
        ("prefetch", tensor.data_ptr(), 1000, device, *flags, 1234),
    ]


def test_no_prefetch_where_the_gpu_cannot_page(runtime) -> None:
    fake = runtime(13000, concurrent=0)
    assert paging.prefetch_paged(_paged(0), to_host=True) is False
    assert [c[0] for c in fake.calls] == ["attribute"]


def test_a_runtime_error_is_a_python_error_naming_the_call(runtime, monkeypatch) -> None:
    fake = runtime(13000)
    monkeypatch.setattr(fake, "cudaMemPrefetchAsync", lambda *args: 1, raising=False)
    fake.cudaGetErrorString = lambda status: b"invalid argument"
    with pytest.raises(RuntimeError, match=r"cudaMemPrefetchAsync\(to the host\) failed: invalid argument \(cudaError 1\)"):
        paging.prefetch_paged(_paged(0), to_host=True)
