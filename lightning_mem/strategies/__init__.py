"""Lightning strategies for memory-efficient training.

Importing this package registers the short strategy names ``fsdp2`` and
``fsdp2_cpu_offload`` with Lightning, so ``Trainer(strategy="fsdp2")`` works.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_mem.strategies.consolidate import full_state_dict
from lightning_mem.strategies.fsdp2 import FSDP2Strategy, parse_dtype

FSDP2Strategy.register_strategies(StrategyRegistry)

__all__ = ["FSDP2Strategy", "full_state_dict", "parse_dtype"]
