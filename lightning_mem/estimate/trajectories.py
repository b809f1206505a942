"""The estimate's multi-turn rollout: every trajectory as long as its budgets allow.

A multi-turn rollout's memory grows with the conversation: the KV cache holds every token of a
trajectory so far, and the update scores whole trajectories. The longest a trajectory can get is
``multi_turn.max_total_tokens`` (prompt, turns and observations together; ``max_turns`` only ends it
sooner), so the estimate samples each row from its prompt straight to that budget in one call of the
recipe's own engine: its prefill is the prompt, its last decode step reads a cache of the whole
budget, and the update gets rows of the whole budget. No environment runs (its text cannot come from
fake tensors), and which of the budget's tokens the environment would have written changes no shape:
every response token is counted as sampled, the costlier case (each is scored).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from lightning_mem.rl.multi_turn import FAULTS, PREFIX, MultiTurnConfig
from lightning_mem.rl.rollout import Experience
from lightning_mem.rl.turn_sampling import device_of


def counter_names(counters: tuple[str, ...]) -> tuple[str, ...]:
    """Every count a multi-turn rollout reports, with an environment's own ``counters``."""
    return tuple(dict.fromkeys((*FAULTS, *counters, "turns", "observation_tokens", "at_budget")))


def zero_extras(n: int, counters: tuple[str, ...]) -> dict[str, Any]:
    """A batch's :func:`~lightning_mem.rl.multi_turn.trajectory_extras` with nothing counted."""
    return {"scores": [0.0] * n, "keep": [True] * n, "prompts": [""] * n, "responses": [""] * n,
            "stats": {PREFIX + name: 0.0 for name in counter_names(counters)}}


def at_budget(spec: Any, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """A separate generator's request as the estimate samples it with an environment: the prompt
    (its last columns, if it is longer than the budget allows), then new tokens to the budget."""
    if spec.environment is None:
        return spec, prompt_ids, prompt_mask
    budget = spec.multi_turn.max_total_tokens
    width = max(1, min(prompt_ids.shape[1], budget - 1))
    spec = replace(spec, generation=replace(spec.generation, max_new_tokens=budget - width))
    return spec, prompt_ids[:, -width:], prompt_mask[:, -width:]


class LongestTrajectories:
    """Stands in for :class:`~lightning_mem.rl.multi_turn.MultiTurnRollout` in the estimate (module
    docstring). ``prompt_tokens``: the prompt's length at this step (the datamodule's longest, or the
    warm-up's short rows); ``fill_token``: the token the estimate's sampling writes."""

    def __init__(self, config: MultiTurnConfig, engine: Any, *, prompt_tokens: Callable[[], int],
                 fill_token: Callable[[], int], counters: tuple[str, ...] = ()) -> None:
        self.config, self.engine = config, engine
        self.prompt_tokens, self.fill_token = prompt_tokens, fill_token
        self.counters = counter_names(counters)

    def rollout(self, model: Any, rows: list[dict[str, Any]], *, synced: bool = False,
                agree_on_count: Callable[[int], int] | None = None) -> Experience:
        budget = self.config.max_total_tokens
        prompt = max(1, min(self.prompt_tokens(), budget - 1))
        device = device_of(model)
        ids = torch.full((len(rows), prompt), int(self.fill_token()), dtype=torch.long, device=device)
        generation = self.engine.config
        self.engine.config = replace(generation, max_new_tokens=budget - prompt)
        try:
            exp = self.engine.generate(model, ids, torch.ones_like(ids), synced=synced)
        finally:
            self.engine.config = generation
        n = len(exp)
        # From data, as a reward rule's scores are: constants the estimate's fake mode keeps real.
        exp.scores = torch.tensor([0.0] * n, device=device)
        exp.sample_keep = torch.tensor([True] * n, device=device)
        exp.prompts, exp.responses = [""] * n, [""] * n  # nothing to decode from fake tokens
        exp.sample_stats.update({PREFIX + name: torch.tensor(0.0, dtype=torch.float64, device=device)
                                 for name in self.counters})
        return exp
