"""The vLLM rollout engine as the estimate sees it: what it holds, where, in each phase.

vLLM cannot run on fake tensors, and the estimate does not need its arithmetic: a colocated engine
is a fixed reservation that the memory plan wakes for the rollout and puts to sleep for the score
and train phases (:mod:`lightning_mem.rl.memory_plan`). :class:`ReservedEngine` stands in for
:class:`~lightning_mem.rl.vllm_engine.VLLMRolloutEngine` under the estimate's ``Trainer.fit``
(the recipe asks its :class:`~lightning_mem.step_io.StepIO` for the engine) and holds, as tensors
the estimate counts:

- **on a CUDA device**: ``gpu_memory_utilization`` of the device's total memory, which is what vLLM
  takes at start-up for its weights, its activation work space and the KV cache that fills the rest
  (vLLM's own rule). The weights (``weights``, in the engine's dtype) are counted apart from the
  rest (``kv_cache``). Asleep at level 1 the weights are on the host and the rest is freed; at
  level 2 both are freed; level 0 keeps everything awake;
- **on the CPU** (vLLM's CPU build): its weights plus ``cpu_kv_cache_space_gb`` of KV cache, always
  (the CPU build has no sleep mode; the engine says so once).

Its rollout samples no tokens through the actor (vLLM's decoding lives inside the reservation): it
returns responses as long as the config allows (one token in the estimate's warm-up step), filled
with the estimate's sampled token. The weight sync runs the real bucketed stream
(:func:`~lightning_mem.rl.weight_sync.weight_buckets`), so its temporaries -- a LoRA actor's merged
weight, a cast bucket -- are counted where the real sync makes them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lightning_mem.estimate.tracker import HOST
from lightning_mem.rl.engine_config import RolloutEngineConfig
from lightning_mem.rl.rollout import Experience, GenerationConfig, RolloutEngine, experience_from_generation
from lightning_mem.rl.weight_sync import checkpoint_weights, weight_buckets
from lightning_mem.settings import SettingError


class ReservedEngine(RolloutEngine):
    """A vLLM engine's memory, on the estimate's ledger (see the module's docstring).

    Args:
        generation: the rollout's generation knobs.
        engine: ``model.rollout_engine``.
        run: the estimate's run (its ledger, and the token the estimate samples).
        on_cuda: the run's accelerator is a CUDA device (sleep mode and ``gpu_memory_utilization``
            apply), not the CPU.
        device_memory: one device's total bytes (needed on CUDA).
        dtype: the engine's weight dtype when ``engine.dtype`` is None (the actor's).
    """

    name = "vllm"
    needs_weight_sync = True

    def __init__(self, generation: GenerationConfig, engine: RolloutEngineConfig, *, run: Any, on_cuda: bool,
                 device_memory: int | None, eos_token_ids: list[int], pad_token_id: int,
                 dtype: torch.dtype = torch.float32, **_: Any) -> None:
        super().__init__(generation, eos_token_ids=eos_token_ids, pad_token_id=pad_token_id)
        from lightning_mem.dtypes import resolve_dtype

        if on_cuda and device_memory is None:
            raise SettingError(
                "--device-memory", " is needed: the vLLM rollout engine takes `model.rollout_engine.gpu_memory_utilization`"
                " of the device's total memory; give the estimate the device's size (--device-memory 80GiB, or a config"
                " with a `# tier:` line)")
        self.engine_config = engine
        self.run = run
        self.on_cuda = on_cuda
        self.device_memory = device_memory
        self.dtype = resolve_dtype(engine.dtype) or dtype
        self.weights: Tensor | None = None  # on the device, or on the host while asleep at level 1
        self.rest: Tensor | None = None  # KV cache (and on CUDA vLLM's activation work space)
        self.sleeping = 0
        self.started = False
        self.weight_bytes = 0  # the engine's weights, known from the first sync
        self.synced_bytes = self.largest_bucket_bytes = 0

    @property
    def supports_sleep(self) -> bool:
        return self.on_cuda

    @property
    def state(self) -> str:
        if not self.started:
            return "stopped"
        return f"asleep(level {self.sleeping})" if self.sleeping else "awake"

    @property
    def weights_lost_in_sleep(self) -> bool:
        return self.sleeping == 2

    # -- what it holds ---------------------------------------------------------------------------
    def _allocate(self, nbytes: int, category: str) -> Tensor:
        with self.run.ledger.section(category):
            return torch.empty(max(nbytes, 0), dtype=torch.uint8)

    def _rest_bytes(self, weight_bytes: int) -> int:
        if self.on_cuda:  # vLLM's whole share of the device, less its weights
            return int(self.engine_config.gpu_memory_utilization * self.device_memory) - weight_bytes
        return self.engine_config.cpu_kv_cache_space_gb << 30

    def start(self) -> None:
        """vLLM starts with (dummy) weights and its KV cache; their size needs the actor, which the
        first :meth:`sync_weights` brings."""
        self.started = True

    def close(self) -> None:
        self.weights = self.rest = None
        self.started = False
        self.sleeping = 0

    @torch.no_grad()
    def sync_weights(self, actor: nn.Module) -> int:
        """The real bucketed stream of the actor's weights (cast to the engine's dtype), copied into
        the engine's weights in place."""
        self.started = True
        bucket_bytes = self.engine_config.sync_bucket_mb << 20
        total, largest = 0, 0
        for bucket in weight_buckets(checkpoint_weights(actor), max_bytes=bucket_bytes, dtype=self.dtype):
            size = sum(t.numel() * t.element_size() for _, t in bucket)
            total, largest = total + size, max(largest, size)
            bucket.clear()
        if self.weights is None:
            self.weight_bytes = total
            self.weights = self._allocate(total, "weights")
            self.rest = self._allocate(self._rest_bytes(total), "kv_cache")
        self.synced_bytes, self.largest_bucket_bytes = total, largest
        return total

    def reserve_beside(self, weight_bytes: int) -> None:
        """Start as a separate generator's engine: awake for good (a generator never sleeps), its
        weights counted by the caller (the generator's copy stands for them: the same tensors in the
        same dtype), so only the rest of vLLM's reservation is allocated here."""
        self.started = True
        self.weight_bytes = weight_bytes
        self.weights = self._allocate(0, "weights")
        self.rest = self._allocate(self._rest_bytes(weight_bytes), "kv_cache")

    def sleep(self, level: int | None = None) -> None:
        level = self.engine_config.sleep_level if level is None else level
        if not self.started or level == 0 or self.sleeping or not self.supports_sleep:
            return
        self.rest = None
        self.weights = None
        if level == 1:  # to pinned host memory, back at the next wake
            self.weights = self._allocate(self.weight_bytes, HOST)
        self.sleeping = level

    def wake(self, tags: list[str]) -> None:
        if not self.sleeping:
            return
        if "weights" in tags:
            self.weights = None  # the host copy goes back to the device
            self.weights = self._allocate(self.weight_bytes, "weights")
        if "kv_cache" in tags:
            self.rest = self._allocate(self._rest_bytes(self.weight_bytes), "kv_cache")
            self.sleeping = 0

    # -- a rollout -------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, *, synced: bool = False,
                 group_size: int = 1) -> Experience:
        if self.weights is None:
            self.start()
            self.sync_weights(model)
        token = int(self.run.mode.fill_token)
        # The warm-up step samples an end of sequence at once: every response is that one token.
        width = 1 if token in self.eos_token_ids else self.config.max_new_tokens
        responses = torch.full((prompt_ids.shape[0], width), token, dtype=prompt_ids.dtype, device=prompt_ids.device)
        sequences = torch.cat([prompt_ids, responses], dim=1)
        exp = experience_from_generation(
            prompt_ids, prompt_mask, sequences, eos_token_ids=self.eos_token_ids, pad_token_id=self.pad_token_id
        )
        exp.engine_logprobs = torch.zeros(exp.response_ids.shape, dtype=torch.float32, device=prompt_ids.device)
        return exp
