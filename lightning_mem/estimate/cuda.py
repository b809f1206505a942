"""What a run on a CUDA device allocates that the estimate's one CPU process on fake tensors does not.

The estimate runs the recipe's own step on the CPU. For a config whose accelerator is a GPU it adds
:class:`CudaDeviceModel`, three parts, each measured against an H100 run of
``configs/ppo/qwen2.5-0.5b-instruct_1x24gb.yaml`` (docs/will_it_fit.md, "The estimate on CUDA"):

1. **Padded micro-batches.** The estimate's batch is the largest the config allows: every row at full
   length, its attention mask all ones. Transformers then builds no mask at all (SDPA runs with
   ``is_causal=True`` and, for grouped-query attention, ``enable_gqa=True``). Real rows differ in
   length (prompts, and responses that end at their own end-of-sequence token), so a real
   micro-batch carries padding and transformers takes its masked path: a ``[B, 1, T, T]`` boolean
   mask for the forward, which SDPA converts to the compute dtype in every layer and keeps for the
   backward (``convert_boolean_attn_mask`` in aten's ``attention.cpp``; the memory-efficient kernel,
   CUDA's choice with a mask, saves it as its bias), and keys and values repeated to all query
   heads (``repeat_kv``, because ``use_gqa_in_sdpa`` refuses a mask on CUDA), which SDPA keeps too.
   The model keeps the estimate's shapes (the worst case), makes the prompt batch's first row one
   token shorter (left padding: ``generate`` drops an all-ones mask, real prompts differ in length),
   and makes transformers treat every mask it is given as padded (:func:`padded_attention_masks`).
   It applies where the step makes its own batches -- a PPO/GRPO step's phases (rollout, score,
   train), whose responses end at their own end-of-sequence token. Micro-batches without a mask
   (packed rows) are unchanged. Not modelled (yet): an SFT batch of rows of different lengths; its
   estimate is the full-length, unpadded batch that ``benchmarks/gpu/tiers.py`` also feeds.
2. **cuBLAS workspaces.** torch gives each cuBLAS handle a workspace per stream from the caching
   allocator, so it counts in ``memory_allocated``, and never frees it (``torch.cuda.empty_cache``
   leaves it; only ``torch._C._cuda_clearCublasWorkspaces`` drops it): 32 MiB on Hopper
   (``parseChosenWorkspaceSize`` in aten's ``CublasHandlePool.cpp``: ``4096 * 8 * 1024`` bytes for
   sm90, 8.125 MiB on older cards), plus cuBLASLt's own workspace (``CUBLASLT_WORKSPACE_SIZE``,
   1 MiB by default). Handles are per thread: the step's forward runs on the main thread, its
   backward on autograd's device thread, so a run that trains holds two of each from its first
   backward on, in every later phase (:data:`CUBLAS_WORKSPACE_BYTES`).
3. **The caching allocator's rounding.** Every block is a multiple of 512 bytes
   (``round_size`` in c10's ``CUDACachingAllocator.cpp``), and ``memory_allocated`` counts the
   block: the ledger rounds each storage up the same way (:data:`ALLOCATOR_ROUND_BYTES`). A large
   block carved from a cached segment can also keep up to 1 MiB of unsplit tail; that depends on
   the history of the cache and is left to the report's margin.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

#: ``round_size``: the caching allocator's smallest block and the multiple every block is rounded to.
ALLOCATOR_ROUND_BYTES = 512
#: cuBLAS's default workspace on Hopper (sm90): ``:4096:8`` KiB, one per handle and stream.
CUBLAS_WORKSPACE_BYTES = 4096 * 8 * 1024
#: cuBLASLt's default workspace (``CUBLASLT_WORKSPACE_SIZE`` = 1024 KiB), one per handle and stream.
CUBLASLT_WORKSPACE_BYTES = 1024 * 1024


@dataclass(frozen=True)
class CudaDeviceModel:
    """The CUDA-only allocations the estimate adds for a GPU config (see the module's docstring).

    Args:
        padded_batches: make transformers build the masked attention path of a padded micro-batch.
        blas_threads: threads that run matmuls and so hold a cuBLAS and a cuBLASLt workspace (the
            main thread, plus autograd's device thread where the step has a backward).
        round_bytes: the allocator's block multiple (1: no rounding).
    """

    padded_batches: bool = True
    blas_threads: int = 2
    round_bytes: int = ALLOCATOR_ROUND_BYTES

    @property
    def workspace_bytes(self) -> int:
        return self.blas_threads * (CUBLAS_WORKSPACE_BYTES + CUBLASLT_WORKSPACE_BYTES)

    @classmethod
    def for_run(cls, *, trains: bool) -> "CudaDeviceModel":
        return cls(blas_threads=2 if trains else 1)

    @contextlib.contextmanager
    def applied(self, padded: Callable[[], bool] = lambda: True) -> Iterator[None]:
        """The model's patches, for the estimate's fit; ``padded()`` says whether the step running now
        makes its own batches (a PPO phase), whose rows differ in length."""
        with padded_attention_masks(padded) if self.padded_batches else contextlib.nullcontext():
            yield


@contextlib.contextmanager
def padded_attention_masks(active: Callable[[], bool] = lambda: True) -> Iterator[None]:
    """While ``active()``, transformers never skips a padding mask it is given: the mask is built as
    for a padded row.

    ``transformers.masking_utils._ignore_causal_mask_sdpa`` lets SDPA run unmasked when the 2-D
    padding mask is all ones; a real micro-batch whose rows differ in length never is. A call
    without a padding mask (packed rows, position ids restarting) keeps its own answer.
    """
    from transformers import masking_utils

    original = getattr(masking_utils, "_ignore_causal_mask_sdpa", None)
    if original is None:  # another transformers: nothing to model
        yield
        return

    def never_skip_a_given_mask(padding_mask: Any, *args: Any, **kwargs: Any) -> bool:
        if padding_mask is not None and active():
            return False
        return original(padding_mask, *args, **kwargs)

    masking_utils._ignore_causal_mask_sdpa = never_skip_a_given_mask
    try:
        yield
    finally:
        masking_utils._ignore_causal_mask_sdpa = original
