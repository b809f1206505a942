"""Host and device allocators: which one this process runs on, and what to do about it.

Offloading moves gigabytes between device and host every step (optimizer state around a PPO
rollout, parameters under FSDP2's CPU offload or ZeRO offload, saved activations). glibc's
``malloc`` serves those host buffers from per-thread arenas and, once a freed chunk is reused for
smaller requests, rarely gives the pages back: resident memory grows step after step although
nothing is leaked (verl #429, #630, #2950, #3453; OpenRLHF #1065; the verl memory guide). Two
fixes, both outside Python:

- run on jemalloc or tcmalloc (``LD_PRELOAD``, see docs/memory_techniques.md), which return
  freed pages to the system; :func:`host_allocator` tells which one this process has loaded, and
  :func:`allocator_advice` the one line to print when host offload runs on glibc;
- on glibc, ``malloc_trim(0)`` after a phase has freed its host buffers hands the free pages
  back (:func:`release_free_host_memory`).

On the device side, :func:`expandable_segments_decision` decides whether a recipe may set
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (fewer fragmentation OOMs when tensor
shapes vary, as in RL), which must stay off under vLLM's sleep mode: its CuMemAllocator cannot
work with expandable segments.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from dataclasses import dataclass
from pathlib import Path

#: Library-name fragments of the allocators that return freed pages, as they appear in
#: ``/proc/self/maps`` (libjemalloc.so.2, libtcmalloc_minimal.so.4, libtcmalloc.so.4...).
_RETURNING_ALLOCATORS = {"libjemalloc": "jemalloc", "libtcmalloc": "tcmalloc"}

#: The Debian/Ubuntu install and preload lines, per allocator (docs/memory_techniques.md says more).
PRELOAD_HINT = (
    "apt-get install libjemalloc2 && "
    "export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 (or libtcmalloc-minimal4: "
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4)"
)


def host_allocator(maps: str | Path = "/proc/self/maps") -> str:
    """``"jemalloc"``, ``"tcmalloc"`` or ``"glibc"``: the ``malloc`` this process runs on, read
    from what it has mapped (``LD_PRELOAD`` or a link-time dependency); ``"unknown"`` where there
    is no ``/proc`` (not Linux)."""
    try:
        text = Path(maps).read_text()
    except OSError:
        return "unknown"
    for fragment, name in _RETURNING_ALLOCATORS.items():
        if fragment in text:
            return name
    return "glibc"


def allocator_advice(host_offload: list[str], allocator: str | None = None) -> str | None:
    """The one line to print when ``host_offload`` (what moves buffers to the host, named as the
    config names it) is non-empty and this process runs on glibc's malloc; None otherwise."""
    allocator = allocator or host_allocator()
    if not host_offload or allocator != "glibc":
        return None
    named = ", ".join(host_offload[:3]) + (f" and {len(host_offload) - 3} more" if len(host_offload) > 3 else "")
    return (
        f"Host offload is on ({named}) and this process uses glibc malloc, whose host memory"
        f" can grow step after step from fragmentation: run it under jemalloc or tcmalloc ({PRELOAD_HINT})."
    )


_libc: ctypes.CDLL | None | bool = False  # False: not looked up yet


def _glibc() -> ctypes.CDLL | None:
    global _libc
    if _libc is False:
        name = ctypes.util.find_library("c")
        try:
            lib = ctypes.CDLL(name) if name else None
            _libc = lib if lib is not None and hasattr(lib, "malloc_trim") else None
        except OSError:
            _libc = None
    return _libc


def release_free_host_memory() -> bool:
    """``malloc_trim(0)``: give glibc's free heap pages back to the system. Returns whether it ran.

    Call it right after host buffers were freed (optimizer state back on the device). It costs a
    walk over the heap (about a millisecond per GiB of heap on this machine) and changes nothing
    that is allocated. A no-op under jemalloc/tcmalloc (they return pages themselves) and where
    there is no glibc.
    """
    if host_allocator() != "glibc":
        return False
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


# ---------------------------------------------------------------------------------------------
# Device: PYTORCH_CUDA_ALLOC_CONF=expandable_segments
# ---------------------------------------------------------------------------------------------

ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"


@dataclass(frozen=True)
class ExpandableSegments:
    """What a recipe does about ``expandable_segments``: ``set`` it (to ``value``) or leave the
    environment as it is, and why."""

    set: bool
    value: str
    reason: str


def expandable_segments_decision(*, vllm_sleep: bool, current: str | None = None, cuda: bool) -> ExpandableSegments:
    """Whether a recipe may turn on ``expandable_segments`` in ``PYTORCH_CUDA_ALLOC_CONF``.

    - never without CUDA: the setting is read by the CUDA caching allocator only;
    - never when the user set ``PYTORCH_CUDA_ALLOC_CONF`` themselves: their value stands;
    - never under vLLM's sleep mode: vLLM's CuMemAllocator maps its pools itself and refuses to
      run with expandable segments (SkyRL switches the setting off around vLLM for this reason);
    - otherwise on: RL steps allocate tensors of varying shapes (rollouts of varying length,
      token-budget micro-batches), which fragments fixed-size segments.
    """
    current = os.environ.get(ALLOC_CONF) if current is None else current
    if not cuda:
        return ExpandableSegments(False, current or "", "no CUDA: the setting is read by the CUDA allocator only")
    if current:
        return ExpandableSegments(False, current, f"{ALLOC_CONF} is already set ({current}); left as it is")
    if vllm_sleep:
        return ExpandableSegments(
            False, "", "vLLM's sleep mode allocates through its own CuMemAllocator, which expandable segments break"
        )
    return ExpandableSegments(True, "expandable_segments:True", "shapes vary step to step: fewer fragmentation OOMs")


def apply_expandable_segments(decision: ExpandableSegments) -> bool:
    """Put ``decision`` into the environment before CUDA initializes; returns whether it did.

    The allocator reads the variable once, when CUDA's caching allocator starts: after that it
    would be a silent no-op, so an initialized CUDA context leaves the environment alone.
    """
    if not decision.set:
        return False
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return False
    os.environ[ALLOC_CONF] = decision.value
    return True


def host_offloads(trainer: object, model: object = None) -> list[str]:
    """What in this run moves buffers between device and host every step, named as a config
    names it: FSDP2's ``cpu_offload``, ZeRO's optimizer or parameter offload, the
    ``ActivationOffload`` and ``OptimizerStateOffload`` callbacks, a PPO memory plan's host
    placements. Read from the built objects, so a strategy chosen by short name counts too."""
    found = []
    strategy = getattr(trainer, "strategy", None)
    if getattr(strategy, "cpu_offload", False) is True:
        found.append("strategy.cpu_offload")
    tier = getattr(strategy, "tier", None)
    if getattr(tier, "offload_optimizer", "none") == "cpu":
        found.append("strategy.offload_optimizer")
    if getattr(tier, "offload_params", "none") == "cpu":
        found.append("strategy.offload_params")
    for callback in getattr(trainer, "callbacks", None) or []:
        if type(callback).__name__ in ("ActivationOffload", "OptimizerStateOffload"):
            found.append(type(callback).__name__)
    plan = getattr(model, "memory_plan", None)
    if hasattr(plan, "host_placements"):
        found += [f"model.memory_plan.{where}" for where in plan.host_placements()]
    return found
