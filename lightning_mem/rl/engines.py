"""Which engine samples the rollouts (YAML ``model.rollout_engine``), and the weights it is fed.

Two engines share one interface (:class:`~lightning_mem.rl.rollout.RolloutEngine`):

- ``hf`` (the default): Hugging Face ``generate`` on the training actor itself. No extra
  dependency, no second copy of the weights, nothing to sync.
- ``vllm``: vLLM in the same process (:mod:`lightning_mem.rl.vllm_engine`, ``pip install
  '.[vllm]'``). It holds its own copy of the weights and a preallocated paged KV cache, so the
  memory plan (:mod:`lightning_mem.rl.memory_plan`) wakes it for the rollout, feeds it the actor's
  weights after every update, and puts it to sleep for the score and train phases.

PPO's logprobs always come from the training actor (the ratio compares the trainer's own
distributions); the engine's own logprobs of the tokens it sampled are kept as a diagnostic.

Weight sync walks the actor's weights in checkpoint (Hugging Face) names and hands them to the
engine in buckets of at most ``sync_bucket_mb``: only a bucket's worth of converted (dtype-cast, or
LoRA-merged) tensors exists at any moment, never a second full copy of the model.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from lightning_mem.settings import AtLeastOne, AtLeastTwo, LeftOpenUnitInterval, SettingError, check_fields

EngineName = Literal["hf", "vllm"]


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
        dtype: the engine's weight dtype; None: the actor's.
        cpu_kv_cache_space_gb: KV cache size on CPU (vLLM's ``VLLM_CPU_KVCACHE_SPACE``); ignored on CUDA.
        seed: the engine's own sampling seed; None draws one from torch's generator, so a seeded
            run samples the same responses.
        tensor_parallel_size: GPUs vLLM splits its copy of the weights over (vLLM's own tensor
            parallelism, its worker processes; independent of the trainer's). CUDA only, with that
            many visible GPUs; weights then reach the workers one bucket at a time.
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
        if self.name == "vllm" and importlib.util.find_spec("vllm") is None:
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


# ---------------------------------------------------------------------------------------------
# The actor's weights, in checkpoint names, for an engine
# ---------------------------------------------------------------------------------------------


def _lora_merged(module: nn.Module) -> Tensor | None:
    """A peft LoRA layer's merged weight (base + every active adapter's delta), or None for others."""
    if not (hasattr(module, "base_layer") and hasattr(module, "lora_A") and hasattr(module, "get_delta_weight")):
        return None
    weight = module.get_base_layer().weight.detach()
    adapters = module.active_adapters if not getattr(module, "disable_adapters", False) else []
    if module.merged:  # already folded in: the base weight is the merged one
        return weight
    merged = weight.clone()
    for name in adapters:
        if name in module.lora_A:
            merged += module.get_delta_weight(name).to(merged.dtype)
    return merged


def checkpoint_weights(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """``(name, tensor)`` for every weight of ``model`` as its Hugging Face checkpoint names them,
    one tensor at a time. A peft (LoRA) model yields merged weights under the base model's names, and
    no adapter tensors; only one merged weight exists at a time.

    Tied weights (``lm_head`` sharing the embedding) are yielded once, under the first name, as
    ``save_pretrained`` does.
    """
    from peft import PeftModel

    base = model.get_base_model() if isinstance(model, PeftModel) else model
    if isinstance(model, PeftModel):
        for module in base.modules():
            if getattr(module, "modules_to_save", None) is not None and hasattr(module, "original_module"):
                raise ValueError(
                    "weight sync: peft `modules_to_save` is not supported with an engine of its own; "
                    "train those modules without it (or use the `hf` rollout engine)"
                )
    lora_prefixes: set[str] = set()
    for mod_name, module in base.named_modules():
        if hasattr(module, "base_layer") and hasattr(module, "lora_A"):
            lora_prefixes.add(mod_name)
    seen: set[int] = set()
    for name, param in base.named_parameters(remove_duplicate=False):
        if ".lora_" in name or "lora_embedding" in name:
            continue
        if id(param) in seen:
            continue
        seen.add(id(param))
        prefix = name.rsplit(".", 2)[0] if ".base_layer." in name else None
        if prefix in lora_prefixes and name.endswith("base_layer.weight"):
            yield prefix + ".weight", _lora_merged(base.get_submodule(prefix))
        else:
            yield name.replace(".base_layer.", "."), param.detach()
    for name, buf in base.named_buffers():
        # Persistent buffers that checkpoints hold (rotary inv_freq is recomputed, and not saved).
        if "inv_freq" not in name:
            yield name.replace(".base_layer.", "."), buf.detach()


def weight_buckets(
    weights: Iterable[tuple[str, Tensor]], *, max_bytes: int, dtype: torch.dtype | None = None, device: Any = None
) -> Iterator[list[tuple[str, Tensor]]]:
    """Group ``weights`` into lists of at most ``max_bytes`` (a tensor larger than that is a bucket of
    its own), cast to ``dtype`` and moved to ``device`` bucket by bucket. Only the current bucket's
    converted tensors are alive: the caller hands each bucket over before asking for the next."""
    bucket: list[tuple[str, Tensor]] = []
    size = 0
    for name, tensor in weights:
        nbytes = tensor.numel() * (dtype.itemsize if dtype is not None and tensor.is_floating_point() else tensor.element_size())
        if bucket and size + nbytes > max_bytes:
            yield bucket
            bucket, size = [], 0
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        if device is not None:
            tensor = tensor.to(device)
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


# ---------------------------------------------------------------------------------------------
# Building an engine, and its diagnostic
# ---------------------------------------------------------------------------------------------


def build_rollout_engine(
    config: RolloutEngineConfig,
    generation: Any,
    *,
    model_path: str,
    eos_token_ids: list[int],
    pad_token_id: int,
    dtype: torch.dtype = torch.float32,
    trust_remote_code: bool = False,
) -> Any:
    """The engine ``config`` names (vLLM is imported only when it is the one)."""
    from lightning_mem.rl.rollout import RolloutEngine

    if config.name == "hf":
        return RolloutEngine(generation, eos_token_ids=eos_token_ids, pad_token_id=pad_token_id)
    from lightning_mem.rl.vllm_engine import VLLMRolloutEngine

    return VLLMRolloutEngine(
        generation, config, model_path=model_path, eos_token_ids=eos_token_ids, pad_token_id=pad_token_id,
        dtype=dtype, trust_remote_code=trust_remote_code,
    )


def logprob_mismatch(engine_logprobs: Tensor, trainer_logprobs: Tensor, mask: Tensor) -> Tensor:
    """Mean absolute difference between the engine's and the trainer's logprobs of the sampled
    tokens, over the response tokens. Large values (different kernels, dtypes, or weights out of
    sync) make the rollout off-policy for the trainer: a known RL failure mode worth watching."""
    cols = min(engine_logprobs.shape[1], trainer_logprobs.shape[1])
    mask = mask[:, :cols].float()
    diff = (engine_logprobs[:, :cols] - trainer_logprobs[:, :cols]).abs() * mask
    return diff.sum() / mask.sum().clamp(min=1)
