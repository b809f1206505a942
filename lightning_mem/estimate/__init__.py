"""Will it fit? A per-phase, per-rank memory estimate of a recipe config, from the recipe's own
fit run on fake tensors (``python -m lightning_mem.estimate --config ...``).

See docs/will_it_fit.md. :func:`estimate` (:mod:`.estimator`) is the entry point: it parses the
config (:mod:`.recipe_config`) and runs the recipe's ``Trainer.fit`` on fake tensors (:mod:`.run`,
:mod:`.fake`), whose phases :mod:`.recorder` records and :mod:`.tracker` counts, one rank's view of
them under a sharding strategy (:mod:`.sharding`, :mod:`.rank_view`); :mod:`.report` and
:mod:`.suggest` (with :mod:`.smaller` when nothing fits) turn it into an answer; :func:`measure_fit` (:mod:`.measure`) runs the config's real fit under the same tracker, on
one or several CPU ranks (:mod:`.sharded`), which is what the estimate is held to.
"""

from lightning_mem.estimate.report import MARGIN_BYTES, MARGIN_FRACTION, parse_size, tier_of, usable_bytes
from lightning_mem.estimate.estimator import Estimate, estimate
from lightning_mem.estimate.recorder import PhaseEstimate
from lightning_mem.estimate.measure import measure_fit
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
    "measure_fit",
    "parse_size",
    "tier_of",
    "usable_bytes",
]
