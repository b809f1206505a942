"""Pad a list of token sequences into one batch tensor: the one place the project does it.

The SFT collator pads on the right (labels with -100), the prompt collator on the left (so that
generation continues every row from the same column), the rollout re-lays ``generate``'s output
on the right, and the reward model pads what it scores: all through :func:`pad_sequences`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor


def pad_sequences(
    sequences: Sequence[Sequence[int] | Tensor],
    pad_value: int,
    *,
    side: Literal["right", "left"] = "right",
    length: int | None = None,
    dtype: torch.dtype = torch.long,
    device: torch.device | str | None = None,
) -> tuple[Tensor, Tensor]:
    """``(padded, mask)``, both ``[len(sequences), length]``: each row holds its sequence at the
    ``side`` end and ``pad_value`` elsewhere; ``mask`` (long) is 1 on the sequence, 0 on padding.

    ``length`` defaults to the longest sequence; a shorter one is an error.
    """
    if side not in ("right", "left"):
        raise ValueError(f"side must be 'right' or 'left', got {side!r}")
    lengths = [len(s) for s in sequences]
    longest = max(lengths, default=0)
    width = longest if length is None else length
    if width < longest:
        raise ValueError(f"length={length} is shorter than the longest sequence ({longest})")
    padded = torch.full((len(sequences), width), pad_value, dtype=dtype, device=device)
    mask = torch.zeros((len(sequences), width), dtype=torch.long, device=device)
    for row, (seq, n) in enumerate(zip(sequences, lengths)):
        if n == 0:
            continue
        cols = slice(0, n) if side == "right" else slice(width - n, width)
        padded[row, cols] = torch.as_tensor(seq, dtype=dtype, device=device)
        mask[row, cols] = 1
    return padded, mask
