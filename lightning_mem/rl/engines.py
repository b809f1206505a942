"""Which engine samples the rollouts (YAML ``model.rollout_engine.name``), and how far it strays.

Two engines share one interface (:class:`~lightning_mem.rl.rollout.RolloutEngine`):

- ``hf`` (the default): Hugging Face ``generate`` on the training actor itself. No extra
  dependency, no second copy of the weights, nothing to sync.
- ``vllm``: vLLM in the same process (:mod:`lightning_mem.rl.vllm_engine`, ``pip install
  '.[vllm]'``). It holds its own copy of the weights and a preallocated paged KV cache, so the
  memory plan (:mod:`lightning_mem.rl.memory_plan`) wakes it for the rollout, feeds it the actor's
  weights after every update, and puts it to sleep for the score and train phases.

PPO's logprobs always come from the training actor (the ratio compares the trainer's own
distributions); the engine's own logprobs of the tokens it sampled are kept as a diagnostic.

The settings both engines read are :mod:`lightning_mem.rl.engine_config`'s, and the weights an engine
with its own copy is fed come from :mod:`lightning_mem.rl.weight_sync`: neither engine imports this
module, so the factory below is the only place that knows both.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_mem.rl.engine_config import EngineName, RolloutEngineConfig

__all__ = ["EngineName", "RolloutEngineConfig", "build_rollout_engine", "logprob_mismatch"]


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
