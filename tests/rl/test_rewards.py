"""The shipped rule-based rewards."""

import pytest

from lightning_mem.data.rows import DataFormatError
from lightning_mem.settings import SettingError
from recipes.rewards import ArithmeticReward, ExactAnswerReward


def test_exact_answer():
    rows = [{"answer": "16"}, {"answer": "16"}]
    assert ExactAnswerReward().score([], [" 16 ", "15"], rows) == [1.0, 0.0]
    with pytest.raises(DataFormatError, match=r"^p.jsonl:2: no `answer`"):
        ExactAnswerReward().score([], ["1"], [{"_where": "p.jsonl:2"}])


def test_arithmetic_reward_by_hand():
    reward = ArithmeticReward(partial=0.5, tolerance=10)
    rows = [{"answer": "16"}] * 6
    # exact; 3 off: 0.5 * (1 - 0.3); 10 off: 0; 20 off: 0 (clipped); words; two numbers
    got = reward(["?"] * 6, ["16", "13", "26", "-4", "sixteen", "16 17"], rows)
    assert got.tolist() == pytest.approx([1.0, 0.35, 0.0, 0.0, 0.0, 0.0])
    last = ArithmeticReward(extract="last_integer")
    assert last.score([], ["11 + 5 = 16.", "It is 14", "no idea"], rows[:3]) == pytest.approx([1.0, 0.4, 0.0])


def test_bad_reward_settings_name_their_key():
    with pytest.raises(SettingError, match=r"^`model.reward.init_args.partial` must be in \[0, 1\), got 1.0$"):
        ArithmeticReward(partial=1.0)
    with pytest.raises(SettingError, match=r"^`model.reward.init_args.extract` must be 'whole' or 'last_integer'"):
        ArithmeticReward(extract="first")
