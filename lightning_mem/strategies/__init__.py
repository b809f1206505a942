"""Lightning strategies for memory-efficient training.

Importing this package registers the short strategy names ``fsdp2`` and
``fsdp2_cpu_offload`` with Lightning, so ``Trainer(strategy="fsdp2")`` works. The DeepSpeed
strategy imports DeepSpeed only when it is built (``pip install 'lightning-mem[deepspeed]'``).
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_mem.export import full_state_dict
from lightning_mem.strategies.deepspeed import (
    ALL_STATES,
    TRAINING_STATES,
    ZeroStrategy,
    deepspeed_phase_offload,
    to_deepspeed_cpu_adam,
)
from lightning_mem.strategies.device_map import DeviceMapStrategy
from lightning_mem.strategies.fsdp2 import FSDP2Strategy
from lightning_mem.strategies.zero_config import ZERO_PRESETS, ZeroTier, deepspeed_config, zero_tier
from lightning_mem.strategies.zero_memory import ZeroMemoryEstimate, zero_memory_estimate

FSDP2Strategy.register_strategies(StrategyRegistry)

__all__ = [
    "ALL_STATES",
    "DeviceMapStrategy",
    "FSDP2Strategy",
    "TRAINING_STATES",
    "ZERO_PRESETS",
    "ZeroMemoryEstimate",
    "ZeroStrategy",
    "ZeroTier",
    "deepspeed_config",
    "deepspeed_phase_offload",
    "full_state_dict",
    "to_deepspeed_cpu_adam",
    "zero_memory_estimate",
    "zero_tier",
]
