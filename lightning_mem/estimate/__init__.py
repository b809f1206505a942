"""Will it fit? A per-phase, per-rank memory estimate of a recipe config, from the recipe's own
step code run on fake tensors (``python -m lightning_mem.estimate --config ...``).

See docs/will_it_fit.md. :func:`estimate` is the entry point; :mod:`.tracker` counts the bytes,
:mod:`.session` runs the recipe, :mod:`.report` and :mod:`.suggest` turn it into an answer;
:mod:`.sharded` runs the same step really sharded (FSDP2, one CPU process per rank) to check the
per-rank derivation.
"""

from lightning_mem.estimate.report import MARGIN_BYTES, MARGIN_FRACTION, parse_size, tier_of, usable_bytes
from lightning_mem.estimate.session import Estimate, PhaseEstimate, estimate
from lightning_mem.estimate.sharded import measure_sharded
from lightning_mem.estimate.tracker import CATEGORIES, MemoryLedger, TrackingMode

__all__ = [
    "CATEGORIES",
    "MARGIN_BYTES",
    "MARGIN_FRACTION",
    "Estimate",
    "MemoryLedger",
    "PhaseEstimate",
    "TrackingMode",
    "estimate",
    "measure_sharded",
    "parse_size",
    "tier_of",
    "usable_bytes",
]
