"""The rollout engine's settings (YAML ``model.rollout_engine``), read by every engine.

Both engines and the factory that picks one (:mod:`lightning_mem.rl.engines`) import this module,
which imports neither of them.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch

from lightning_mem.settings import AtLeastOne, AtLeastTwo, LeftOpenUnitInterval, SettingError, check_fields

EngineName = Literal["hf", "vllm"]
Placement = Literal["colocated", "separate"]

# False while the memory estimate runs a recipe: it builds a stand-in for the engine
# (lightning_mem.estimate.engine), so the engine need not be installed where the estimate runs.
_ENGINE_RUNS = contextvars.ContextVar("lightning_mem_engine_runs", default=True)


@contextlib.contextmanager
def engines_stood_in() -> Iterator[None]:
    """Inside: :meth:`RolloutEngineConfig.validate` does not ask for the engine's package (the
    memory estimate of a vLLM config, on a machine without vLLM)."""
    token = _ENGINE_RUNS.set(False)
    try:
        yield
    finally:
        _ENGINE_RUNS.reset(token)


@dataclass
class RolloutEngineConfig:
    """The rollout engine and its memory knobs (in the PPO recipe: ``model.rollout_engine``).

    Args:
        name: ``hf`` (Hugging Face ``generate`` on the actor) or ``vllm`` (vLLM in this process;
            the knobs below apply to it only).
        gpu_memory_utilization: the fraction of the device's *total* memory vLLM may use for its
            weights, activations and KV cache (vLLM's own knob). In a colocated run the actor,
            its optimizer state and the frozen models share the device: leave them room. Unused on CPU,
            where ``cpu_kv_cache_space_gb`` sizes the KV cache instead.
        enforce_eager: no CUDA graphs (they cost memory and start-up time; vLLM's knob).
        max_num_seqs: sequences vLLM decodes at once (its scheduler's batch).
        max_model_len: prompt + response tokens per sequence; sizes the KV cache's blocks per
            sequence. None: the model's maximum.
        sleep_level: what the engine frees between rollouts. 0: nothing (stays awake); 1: the KV
            cache is discarded and the weights go to host memory; 2: both discarded (weights are
            re-synced from the actor at the next rollout anyway). Needs vLLM's sleep mode, which
            CUDA has and the CPU build has not: on CPU it is a no-op, with one warning.
        sync_bucket_mb: weight sync hands the engine at most this many MiB of tensors at a time.
        dtype: the engine's weight dtype; None: the compute dtype of ``trainer.precision``
            (bfloat16 under ``bf16-mixed``, not the actor's fp32 master weights).
        cpu_kv_cache_space_gb: KV cache size on CPU (vLLM's ``VLLM_CPU_KVCACHE_SPACE``); ignored on CUDA.
        seed: the engine's own sampling seed; None draws one from torch's generator, so a seeded
            run samples the same responses.
        tensor_parallel_size: GPUs vLLM splits its copy of the weights over (vLLM's own tensor
            parallelism, its worker processes; independent of the trainer's). CUDA only, with that
            many visible GPUs; weights then reach the workers one bucket at a time.
        placement: ``colocated`` (the default): the training processes sample the rollouts
            themselves, between updates. ``separate``: generator processes of their own, each with
            its own copy of the actor, sample ahead of training within ``async_rollout.max_staleness``
            versions (:mod:`lightning_mem.rl.async_client`), with the engine ``name`` names: ``hf``
            (a Hugging Face copy) or ``vllm`` (vLLM holds the copy; one device per generator, and
            the generator never sleeps, so ``sleep_level`` is unused there).
    """

    name: EngineName = "hf"
    gpu_memory_utilization: LeftOpenUnitInterval = 0.3
    enforce_eager: bool = True
    max_num_seqs: AtLeastOne = 256
    max_model_len: AtLeastTwo | None = None  # a prompt token and a response token at least
    sleep_level: Literal[0, 1, 2] = 1
    sync_bucket_mb: AtLeastOne = 256
    dtype: str | None = None
    cpu_kv_cache_space_gb: AtLeastOne = 1
    seed: int | None = None
    tensor_parallel_size: AtLeastOne = 1
    placement: Placement = "colocated"

    def __post_init__(self) -> None:
        check_fields(self)  # the ranges are the annotations (the CLI checks them while parsing)
        from lightning_mem.dtypes import resolve_dtype

        resolve_dtype(self.dtype, key="dtype")

    def validate(self, generation: Any = None) -> None:
        """Check that this environment can run the engine and (given the run's
        :class:`~lightning_mem.rl.rollout.GenerationConfig`) that the generation settings suit it.
        The one place this is checked: the recipe calls it before any model loads, and an engine
        built directly calls it too. Errors name ``rollout_engine.<field>`` and
        ``generation.<field>`` (a recipe names their parent, ``settings_at("model")``)."""
        if self.tensor_parallel_size > 1:
            self._check_tensor_parallel()
        if self.name == "vllm" and _ENGINE_RUNS.get() and importlib.util.find_spec("vllm") is None:
            raise SettingError(
                "rollout_engine.name",
                "`rollout_engine.name: vllm` needs vLLM, which is not installed in this environment: "
                "`pip install '.[vllm]'` (vLLM's CPU build, in a venv of its own: `make vllm-install`), "
                "or `pip install vllm` on a CUDA machine",
            )
        if generation is not None and self.name != "hf" and generation.kv_cache == "static":
            raise SettingError(
                "generation.kv_cache",
                f"`generation.kv_cache: static` is the Hugging Face engine's; `rollout_engine.name: {self.name}`"
                " pages its own KV cache (size it with its knobs)",
                siblings=("rollout_engine.name",),
            )

    def _check_tensor_parallel(self) -> None:
        tp = self.tensor_parallel_size
        if self.placement == "separate":
            raise SettingError(
                "rollout_engine.tensor_parallel_size",
                f"={tp} with `rollout_engine.placement: separate`: each generator holds its copy on one device"
                " (`async_rollout.generator_devices` sets how many generate); use 1",
                siblings=("rollout_engine.placement",),
            )
        if self.name != "vllm":
            raise SettingError(
                "rollout_engine.tensor_parallel_size",
                f"`rollout_engine.tensor_parallel_size`={tp} is vLLM's; the `hf` engine generates with the actor as the"
                " trainer's strategy split it (set the strategy's `tensor_parallel_size` instead)",
                siblings=("rollout_engine.name",),
            )
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus < tp:
            raise SettingError(
                "rollout_engine.tensor_parallel_size",
                f"={tp} splits vLLM's weights over {tp} GPUs; this machine has {gpus} visible"
                + (" (vLLM's CPU build runs one worker)" if gpus == 0 else ""),
            )
