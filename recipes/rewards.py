"""Rule-based rewards for the PPO recipe, chosen in YAML by ``model.reward.class_path``.

Write your own by subclassing :class:`lightning_mem.rl.reward.RewardFunction` and pointing
``class_path`` at it; ``init_args`` become its constructor arguments.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from lightning_mem.data.rows import DataFormatError
from lightning_mem.rl.reward import RewardFunction
from lightning_mem.settings import SettingError, settings_at

_INTEGER = re.compile(r"^\s*(-?\d+)\s*$")
_ANY_INTEGER = re.compile(r"-?\d+")


class ExactAnswerReward(RewardFunction):
    """1 when the response, stripped, equals the row's answer (``answer_key``), else 0."""

    def __init__(self, answer_key: str = "answer") -> None:
        self.answer_key = answer_key

    def required_keys(self) -> list[str]:
        return [self.answer_key]

    def _answer(self, row: dict[str, Any]) -> str:
        if self.answer_key not in row:
            raise DataFormatError(f"{row.get('_where', 'a prompt row')}: no `{self.answer_key}` for the reward to check against")
        return str(row[self.answer_key]).strip()

    def score(self, prompts: list[str], responses: list[str], rows: list[dict[str, Any]]) -> Sequence[float]:
        return [float(r.strip() == self._answer(row)) for r, row in zip(responses, rows)]


class ArithmeticReward(ExactAnswerReward):
    """A graded reward in [0, 1] for integer answers (the shipped arithmetic data).

    - 1.0 for the exact answer;
    - ``partial * max(0, 1 - |guess - answer| / tolerance)`` for any other integer, the only
      text in the response: partial credit that grows as the guess gets closer;
    - 0 for anything that is not a bare integer (words, two numbers, an empty response).

    ``extract="last_integer"`` judges the last integer in the response instead (a chat model's
    "11 + 5 = 16." counts as 16), for instruction-tuned policies that explain before answering.

    Why graded: a policy that rarely gets the exact answer (a short warm-up, a hard prompt set)
    sees an exact-match reward of 0 for most samples, and the policy gradient has little to go
    on. Closeness is dense and points the same way; with ``partial`` at most 0.5
    an exact answer is always worth at least twice any near miss. ``partial=0`` is
    :class:`ExactAnswerReward`.
    """

    def __init__(
        self, answer_key: str = "answer", partial: float = 0.5, tolerance: float = 10.0, extract: str = "whole"
    ) -> None:
        super().__init__(answer_key)
        with settings_at("model.reward.init_args"):
            if extract not in ("whole", "last_integer"):
                raise SettingError("extract", f" must be 'whole' or 'last_integer', got {extract!r}")
            if not 0 <= partial < 1:
                raise SettingError("partial", f" must be in [0, 1), got {partial}")
            if tolerance <= 0:
                raise SettingError("tolerance", f" must be positive, got {tolerance}")
        self.extract = extract
        self.partial, self.tolerance = partial, tolerance

    def _guess(self, response: str) -> str | None:
        if self.extract == "last_integer":
            found = _ANY_INTEGER.findall(response)
            return found[-1] if found else None
        match = _INTEGER.match(response)
        return None if match is None else match.group(1)

    def _one(self, response: str, answer: str) -> float:
        guess = self._guess(response)
        if guess is None:
            return 0.0
        if guess == answer:
            return 1.0
        try:
            distance = abs(int(guess) - int(answer))
        except ValueError:  # a non-integer answer: only an exact match counts
            return 0.0
        return self.partial * max(0.0, 1.0 - distance / self.tolerance)

    def score(self, prompts: list[str], responses: list[str], rows: list[dict[str, Any]]) -> Sequence[float]:
        return [self._one(r, self._answer(row)) for r, row in zip(responses, rows)]
