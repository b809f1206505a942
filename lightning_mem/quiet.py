"""Warnings a user of the recipes cannot act on, silenced with the reason for each.

A run should print only what asks for an action; each entry here is a message that every run of
a recipe would print although nothing in the user's config causes or could fix it. Anything not
listed still prints.
"""

from __future__ import annotations

import warnings

#: (message regex, why it does not apply to the recipes)
UNACTIONABLE: tuple[tuple[str, str], ...] = (
    (
        r"You're resuming from a checkpoint that ended before the epoch ended and your dataloader is not resumable",
        "TokenBudgetSampler resumes by position (the batches already run), so a mid-epoch resume sees exactly"
        " the batches an uninterrupted run would",
    ),
    (
        r"Starting from v1\.9\.0, `tensorboardX` has been removed",
        "a note about Lightning's default logger choice, printed on every run that keeps the default",
    ),
    (
        r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        "raised inside Lightning's own code under torch >= 2.10, once per rank",
    ),
)


def silence_unactionable_warnings() -> None:
    """Install ignore filters for :data:`UNACTIONABLE` (process-wide; call it from a recipe's entry point)."""
    for pattern, _reason in UNACTIONABLE:
        warnings.filterwarnings("ignore", message=pattern)
