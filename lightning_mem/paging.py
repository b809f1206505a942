"""Can this platform page? CUDA managed memory, asked through the CUDA runtime.

bitsandbytes' paged optimizers keep large state tensors in CUDA managed ("unified") memory, which
the driver moves page by page between the GPU and the host when the GPU runs short. That needs
*concurrent managed access* (``cudaDevAttrConcurrentManagedAccess``): Linux on Pascal or newer,
outside most virtualization. Windows, WSL2, Jetson and virtual GPUs without unified memory lack
it; there managed memory cannot oversubscribe the GPU (paging saves nothing), and on a virtual GPU
without unified memory a managed allocation can fail outright.

Two things here:

- :func:`paging_supported` answers, for a device, through the module-level hook
  :data:`paging_query` (default :func:`concurrent_managed_access`), or through a ``query``
  argument. Tests replace the hook to take either branch on a CPU-only machine.
- :func:`prefetch_paged` moves a paged buffer's pages to the host or back to its GPU, in place,
  with the CUDA runtime's ``cudaMemPrefetchAsync``. It is the call
  ``bitsandbytes.functional.prefetch_tensor(..., to_cpu=True)`` means to make, but that one
  (bitsandbytes 0.50, and its main branch as of 2026-08) first asks ``cudaDeviceGetAttribute`` about device ``-1``, the
  host, which is no device ordinal: the C library prints ``Error invalid device ordinal at line
  568 in file .../pythonInterface.cpp`` and calls ``exit(1)``, on every platform. Its
  device-bound prefetch (a real device ordinal) is safe, and bitsandbytes' own step uses only that.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Callable, Optional

import torch

#: ``cudaDevAttrConcurrentManagedAccess`` in ``cuda_runtime_api.h``.
CONCURRENT_MANAGED_ACCESS = 89
#: ``cudaCpuDeviceId``: the host, where a CUDA 12 runtime call takes a device ordinal.
CPU_DEVICE_ID = -1
# ``cudaMemLocationType`` (CUDA >= 13 takes a location instead of an ordinal).
_LOCATION_DEVICE = 1
_LOCATION_HOST = 2

PagingQuery = Callable[[torch.device], bool]


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


@functools.lru_cache(maxsize=1)
def _runtime() -> ctypes.CDLL:
    """The CUDA runtime library this process already uses (torch loads it), else the one the
    loader finds for torch's CUDA major version."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if "/libcudart.so" in path:
                    return ctypes.CDLL(path)
    except OSError:
        pass
    major = (torch.version.cuda or "").split(".")[0]
    name = f"libcudart.so.{major}" if major else ctypes.util.find_library("cudart")
    if not name:
        raise OSError("lightning_mem.paging: no CUDA runtime library (libcudart) found")
    return ctypes.CDLL(name)  # OSError where the loader cannot find it


def _check(status: int, call: str) -> None:
    if status != 0:
        lib = _runtime()
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        raise RuntimeError(f"{call} failed: {lib.cudaGetErrorString(status).decode()} (cudaError {status})")


@functools.lru_cache(maxsize=1)
def _runtime_version() -> int:
    version = ctypes.c_int(0)
    _check(_runtime().cudaRuntimeGetVersion(ctypes.byref(version)), "cudaRuntimeGetVersion")
    return version.value


def _cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def concurrent_managed_access(device: torch.device | str) -> bool:
    """Whether ``device`` can page CUDA managed memory (``cudaDevAttrConcurrentManagedAccess``).

    False for anything but an available CUDA device. Asks the CUDA runtime: torch's device
    properties do not carry this attribute.
    """
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    torch.cuda.init()
    value = ctypes.c_int(0)
    try:
        runtime = _runtime()
    except OSError:
        # NOTE: no runtime library to open (a build that links it statically): the driver API
        # numbers this attribute the same (CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS), and
        # torch has initialized the driver.
        status = ctypes.CDLL("libcuda.so.1").cuDeviceGetAttribute(
            ctypes.byref(value), CONCURRENT_MANAGED_ACCESS, _cuda_index(device)
        )
        if status != 0:
            raise RuntimeError(f"cuDeviceGetAttribute(CONCURRENT_MANAGED_ACCESS) failed: CUresult {status}") from None
        return bool(value.value)
    status = runtime.cudaDeviceGetAttribute(ctypes.byref(value), CONCURRENT_MANAGED_ACCESS, _cuda_index(device))
    _check(status, "cudaDeviceGetAttribute(cudaDevAttrConcurrentManagedAccess)")
    return bool(value.value)


#: The question :func:`paging_supported` asks when no ``query`` is given: a function of the device
#: (CPU included) that says whether paged state can page there. Replace it to run the other branch
#: in a test, or for a platform whose answer you know better.
paging_query: PagingQuery = concurrent_managed_access


def paging_supported(device: torch.device | str, query: Optional[PagingQuery] = None) -> bool:
    """Whether paged (managed-memory) optimizer state can page on ``device``.

    ``query`` answers instead of :data:`paging_query` (default: concurrent managed access, so
    never on CPU).
    """
    return bool((query or paging_query)(torch.device(device)))


def no_paging_reason(device: torch.device | str) -> str:
    """Why :func:`paging_supported` said no, in words for a warning or an error."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"its parameters are on {device.type}, and paging needs CUDA managed memory"
    return (
        f"{device} has no concurrent managed access (cudaDevAttrConcurrentManagedAccess is 0, as on "
        f"WSL2, Windows, Jetson and virtual GPUs), so managed memory cannot page there"
    )


def paged_device(tensor: torch.Tensor) -> torch.device:
    """The GPU a bitsandbytes paged buffer belongs to (torch sees a CPU tensor)."""
    return torch.device("cuda", getattr(tensor, "page_deviceid", None) or 0)


def prefetch_paged(tensor: torch.Tensor, to_host: bool, query: Optional[PagingQuery] = None) -> bool:
    """Start moving a bitsandbytes paged buffer's pages to the host (``to_host``) or to its GPU.

    In place and asynchronous, on the GPU's current stream, so it is ordered after the kernels
    that wrote the state; synchronize before relying on where the pages are. Returns whether a
    prefetch was issued: where the GPU cannot page (:func:`paging_supported`), none is, and the
    pages stay where the driver keeps them. A failing runtime call, or no runtime library to call,
    raises ``RuntimeError`` (a Python error the run can report, where bitsandbytes exits).
    """
    device = paged_device(tensor)
    if not paging_supported(device, query):
        return False
    nbytes = tensor.numel() * tensor.element_size()
    try:
        _runtime_prefetch(tensor.data_ptr(), nbytes, device, to_host)
    except OSError as error:
        raise RuntimeError(f"prefetch_paged: no CUDA runtime library for cudaMemPrefetchAsync ({error})") from error
    return True


def _runtime_prefetch(pointer: int, nbytes: int, device: torch.device, to_host: bool) -> None:
    """``cudaMemPrefetchAsync`` of ``nbytes`` at ``pointer`` to the host or to ``device``, on
    ``device``'s current stream."""
    stream = ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream)
    lib = _runtime()
    index = _cuda_index(device)
    # NOTE: CUDA 13 replaced the destination ordinal (cudaCpuDeviceId for the host) by a location
    # struct plus flags, under the same symbol; the loaded runtime's version picks the signature.
    if _runtime_version() >= 13000:
        location = _MemLocation(_LOCATION_HOST, 0) if to_host else _MemLocation(_LOCATION_DEVICE, index)
        status = lib.cudaMemPrefetchAsync(
            ctypes.c_void_p(pointer), ctypes.c_size_t(nbytes), location, ctypes.c_uint(0), stream
        )
    else:
        target = CPU_DEVICE_ID if to_host else index
        status = lib.cudaMemPrefetchAsync(
            ctypes.c_void_p(pointer), ctypes.c_size_t(nbytes), ctypes.c_int(target), stream
        )
    _check(status, f"cudaMemPrefetchAsync(to {'the host' if to_host else device})")
