"""The multi-turn rollout loop: budgets, faults and the two turn samplers.

A scripted sampler stands in for the model where a test needs control of what is "sampled" (its
turns are the ids of scripted texts): every fault of the issue (a call that does not parse, a tool or
an environment that raises or hangs, an observation past the budget) has its stated behaviour and
count, and the rollout returns. The hf samplers run the tiny model: continuing the KV cache across
turns samples exactly what prefilling every conversation again samples, while each turn prefills
only its new ids and the batch sheds the rows that ended.
"""

from __future__ import annotations

import contextlib
import time

import pytest
import torch
from transformers import AutoTokenizer

from lightning_mem.models import load_causal_lm
from lightning_mem.rl.environments import Environment, RewardEnvironment, Step
from lightning_mem.rl.multi_turn import FAULTS, MultiTurnConfig, MultiTurnRollout, multi_turn_rollout, trajectory_metrics
from lightning_mem.rl.rollout import GenerationConfig, RolloutEngine
from lightning_mem.rl.tools import ToolEnvironment
from lightning_mem.rl.trajectory import ChatRenderer
from lightning_mem.settings import SettingError
from recipes.environments import ArithmeticRetry
from recipes.rewards import ArithmeticReward
from tests.helpers import TINY_MODEL

EOS, PAD = 1, 0


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TINY_MODEL)


class Scripted:
    """A turn sampler whose turn ``k`` of trajectory ``i`` is ``script(i, k)``'s ids and the end token."""

    def __init__(self, tokenizer, script) -> None:
        self.tokenizer, self.script, self.turn = tokenizer, script, {}

    @contextlib.contextmanager
    def session(self, model):
        yield

    def sample(self, model, rows, new_ids, max_new_tokens, *, synced=False):
        out = []
        for r in rows:
            k = self.turn.get(r, 0)
            self.turn[r] = k + 1
            ids = self.tokenizer(self.script(r, k), add_special_tokens=False)["input_ids"] + [EOS]
            out.append(ids[:max_new_tokens])
        return out


def scripted_rollout(tokenizer, environment, script, *, max_new_tokens=256, counters=(), **config) -> MultiTurnRollout:
    renderer = ChatRenderer(tokenizer, end_token_ids=[EOS])
    return MultiTurnRollout(environment, MultiTurnConfig(**config), renderer, Scripted(tokenizer, script),
                            max_new_tokens=max_new_tokens, eos_token_ids=[EOS], pad_token_id=PAD, counters=counters)


MODEL = torch.nn.Linear(1, 1)  # the scripted rollout only asks the model for its device
ROW = {"prompt": "What is 12 + 7?", "answer": "19"}


def stats(exp) -> dict[str, float]:
    return {k.removeprefix("multi_turn/"): float(v) for k, v in exp.sample_stats.items()}


def test_a_tool_call_its_result_and_the_answer_make_one_buffer(tokenizer):
    env = lambda: ToolEnvironment(tools=["recipes.tools.calculator"], reward=ArithmeticReward())  # noqa: E731
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "12 + 7"}}</tool_call>'
    exp = scripted_rollout(tokenizer, env, lambda i, k: [call, "19"][k], counters=ToolEnvironment.counters).rollout(MODEL, [ROW])
    text = tokenizer.decode(exp.input_ids[0][exp.attention_mask[0].bool()])
    assert text == (f"<|user|>\nWhat is 12 + 7?\n<|assistant|>\n{call}<|eos|><|tool|>\n19\n<|assistant|>\n19<|eos|>")
    sampled = exp.response_ids[0][exp.response_mask[0].bool()]
    assert tokenizer.decode(sampled) == f"{call}<|eos|>19<|eos|>"  # the tool's tokens are context, not actions
    assert exp.scores.tolist() == [1.0] and exp.sample_keep.tolist() == [True] and exp.responses == ["19"]
    s = stats(exp)
    assert s["turns"] == 2 and s["tool_calls"] == 1 and s["at_budget"] == 0
    assert s["observation_tokens"] == (exp.attention_mask.sum() - exp.prompt_lengths.sum() - exp.response_mask.sum())


class Faulty(Environment):
    """Answers "Again." each turn; at turn ``fault_at`` does what ``fault`` says."""

    def __init__(self, fault: str, fault_at: int = 1) -> None:
        self.fault, self.fault_at, self.turn = fault, fault_at, 0

    def reset(self, row):
        if self.fault == "reset_raises":
            raise RuntimeError("no such task")
        return [{"role": "user", "content": "Go."}]

    def step(self, message):
        self.turn += 1
        if self.turn == self.fault_at:
            if self.fault == "step_raises":
                raise RuntimeError("sandbox died")
            if self.fault == "step_hangs":
                time.sleep(30)
            if self.fault == "step_returns_junk":
                return "done"
            if self.fault == "long_observation":
                return Step([{"role": "user", "content": "x" * 200}], 0.5, False)
        return Step([{"role": "user", "content": "Again."}], 0.25, False)


@pytest.mark.parametrize(("fault", "count", "failed"), [
    ("reset_raises", "env_errors", True),
    ("step_raises", "env_errors", True),
    ("step_returns_junk", "env_errors", True),
    ("step_hangs", "env_timeouts", True),
    ("long_observation", "observations_cut", False),
])
def test_an_environment_fault_ends_its_trajectory_counted_and_the_others_go_on(tokenizer, fault, count, failed):
    envs = iter([Faulty(fault, fault_at=2), Faulty("none")])
    rollout = scripted_rollout(tokenizer, lambda: next(envs), lambda i, k: "ok", max_turns=3, max_total_tokens=120,
                               at_budget="score", step_timeout_s=0.2)
    exp = rollout.rollout(MODEL, [ROW, ROW])
    s = stats(exp)
    assert s[count] == 1 and sum(s[name] for name in FAULTS) == 1
    assert exp.sample_keep.tolist() == [not failed, True]  # a failed trajectory does not train
    assert exp.scores[1] == 0.75  # the healthy neighbour ran its three turns (to max_turns: at its budget)
    if fault == "long_observation":  # ended at its budget with what it had collected: two steps' rewards
        assert exp.scores[0] == 0.75 and s["at_budget"] == 2 and exp.response_mask[0].sum() == 2 * 3  # "ok" + end, twice


@pytest.mark.parametrize("at_budget", ["mask", "score"])
def test_budgets_end_trajectories_and_at_budget_decides_whether_they_train(tokenizer, at_budget):
    envs = iter([Faulty("none"), RewardEnvironment(ArithmeticReward())])
    rollout = scripted_rollout(tokenizer, lambda: next(envs), lambda i, k: "19", max_turns=2, at_budget=at_budget)
    exp = rollout.rollout(MODEL, [ROW, ROW])
    # The first ran out of turns (its environment never said done); the second ended by itself.
    assert stats(exp)["turns"] == 3 and stats(exp)["at_budget"] == 1
    assert exp.sample_keep.tolist() == [at_budget == "score", True]
    assert exp.scores.tolist() == [0.5, 1.0]


def test_a_turn_cut_by_the_token_budget_ends_at_the_budget(tokenizer):
    rollout = scripted_rollout(tokenizer, lambda: Faulty("none"), lambda i, k: "a long answer of many tokens",
                               max_total_tokens=20)
    exp = rollout.rollout(MODEL, [ROW])
    assert exp.attention_mask.sum() == 20 and stats(exp)["turns_cut"] == 1 and stats(exp)["at_budget"] == 1
    assert exp.sample_keep.tolist() == [False]
    over = scripted_rollout(tokenizer, lambda: Faulty("none"), lambda i, k: "x", max_total_tokens=5).rollout(MODEL, [ROW])
    assert stats(over)["prompts_over_budget"] == 1 and over.response_mask.sum() == 0


def test_a_rendering_that_is_not_a_suffix_ends_the_trajectory(tokenizer):
    counting = "{{ messages | length }}{% for m in messages %}{{ m.content }}{% endfor %}"  # every turn rewrites the start
    renderer = ChatRenderer(tokenizer, end_token_ids=[EOS], chat_template=counting)
    rollout = MultiTurnRollout(lambda: Faulty("none"), MultiTurnConfig(), renderer, Scripted(tokenizer, lambda i, k: "ok"),
                               max_new_tokens=8, eos_token_ids=[EOS], pad_token_id=PAD)
    exp = rollout.rollout(MODEL, [ROW])
    assert stats(exp)["template_mismatch"] == 1 and exp.sample_keep.tolist() == [False]


def test_the_metrics_are_per_trajectory_means_and_counts():
    totals = {"samples": torch.tensor(4.0), "multi_turn/turns": torch.tensor(6.0), "multi_turn/at_budget": torch.tensor(1.0),
              "multi_turn/observation_tokens": torch.tensor(20.0), "multi_turn/env_errors": torch.tensor(2.0)}
    metrics = trajectory_metrics(totals)
    assert {k: float(v) for k, v in metrics.items()} == {
        "multi_turn/turns_mean": 1.5, "multi_turn/observation_tokens_mean": 5.0, "multi_turn/at_budget_frac": 0.25,
        "multi_turn/env_errors": 2.0}
    assert trajectory_metrics({"samples": torch.tensor(4.0)}) == {}


def test_the_arithmetic_retry_environment():
    env = ArithmeticRetry(tries=3, retry_discount=0.5)
    env.reset({"prompt": "What is 2 + 3?", "answer": "5"})
    assert env.step({"role": "assistant", "content": "6"}) == Step([{"role": "user", "content": "Wrong. Try again."}], 0.0, False)
    assert env.step({"role": "assistant", "content": "five"}).done is False
    assert env.step({"role": "assistant", "content": " 5 "}) == Step([], 0.25, True)
    assert env.metrics() == {"retries": 2, "solved_on_retry": 1}
    env.reset({"prompt": "What is 2 + 3?", "answer": "5"})
    assert env.step({"role": "assistant", "content": "5"}) == Step([], 1.0, True)
    with pytest.raises(SettingError, match=r"^`model.environment.init_args.retry_discount` must be in \[0, 1\], got 2$"):
        ArithmeticRetry(retry_discount=2)
    with pytest.raises(SettingError, match=r"^`model.environment.init_args.tries` must be positive, got 0$"):
        ArithmeticRetry(tries=0)


# -- the hf samplers on the tiny model ---------------------------------------------------------------


class Uneven(Environment):
    """Episodes of 1 to 3 turns by the row's ``turns``; replies of the row's ``reply`` length."""

    def reset(self, row):
        self.row, self.turn = row, 0
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, message):
        self.turn += 1
        done = self.turn >= self.row["turns"]
        return Step([{"role": "user", "content": "more " * self.row["reply"]}], float(self.turn), done)


ROWS = [{"prompt": "What is 3 + 4?", "turns": 3, "reply": 1}, {"prompt": "Compute 11 - 2.", "turns": 1, "reply": 2},
        {"prompt": "9 + 9 =", "turns": 2, "reply": 5}, {"prompt": "Calculate 8 - 1.", "turns": 3, "reply": 3}]


def sampled_spans(mask: list[int]) -> list[tuple[int, int]]:
    """``(start, end)`` columns of each run of sampled tokens: a trajectory's turns."""
    edges = [j for j in range(len(mask)) if mask[j] and (j == 0 or not mask[j - 1])]
    return [(j, next((e for e in range(j, len(mask)) if not mask[e]), len(mask))) for j in edges]


def _rollouts(tokenizer, generation):
    engine = RolloutEngine(generation, eos_token_ids=[EOS], pad_token_id=PAD)
    config = dict(tokenizer=tokenizer, generation=generation, engine=engine, eos_token_ids=[EOS], pad_token_id=PAD)
    return {cached: multi_turn_rollout(Uneven, MultiTurnConfig(max_turns=3, cache_across_turns=cached), **config)
            for cached in (True, False)}


def test_continuing_the_cache_samples_what_prefilling_every_turn_samples(tokenizer):
    torch.manual_seed(0)
    model = load_causal_lm(str(TINY_MODEL))
    generation = GenerationConfig(max_new_tokens=5, do_sample=False)
    exps, widths = {}, {}
    for cached, rollout in _rollouts(tokenizer, generation).items():
        seen = []
        hook = model.register_forward_pre_hook(lambda m, a, kw: seen.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
        exps[cached] = rollout.rollout(model, ROWS)
        hook.remove()
        widths[cached] = seen
    for name in ("input_ids", "attention_mask", "response_ids", "response_mask", "scores"):
        assert torch.equal(getattr(exps[True], name), getattr(exps[False], name)), name
    assert exps[True].response_mask.sum() > 0 and stats(exps[True])["turns"] == 9
    # Each turn's first forward (its prefill): the cached rollout feeds only the turn's new ids (the
    # last sampled token, which the cache has not seen, and the observation) to the rows still
    # running; prefilling feeds each running row's whole conversation again.
    exp = exps[True]
    prefills = {cached: [s for s in w if s[1] > 1] for cached, w in widths.items()}
    spans = [sampled_spans(row) for row in exp.response_mask.tolist()]  # each row's turns, in response columns
    prompts = exp.prompt_lengths.tolist()
    expected_cached, expected_prefill = [], []
    for k in range(max(map(len, spans))):
        running = [i for i, turns in enumerate(spans) if len(turns) > k]
        new_ids = [prompts[i] if k == 0 else 1 + spans[i][k][0] - spans[i][k - 1][1] for i in running]
        expected_cached.append((len(running), max(new_ids)))
        expected_prefill.append((len(running), max(prompts[i] + spans[i][k][0] for i in running)))
    assert [rows for rows, _ in expected_cached] == [4, 3, 2]  # the batch sheds the rows that ended
    padded = _rollouts(tokenizer, generation)[True]
    padded.sampler.shrink = False  # the rows that ended ride along instead: same trajectories, more work
    assert torch.equal(padded.rollout(model, ROWS).input_ids, exp.input_ids)
    assert prefills[True] == expected_cached and prefills[False] == expected_prefill
    assert sum(r * w for r, w in prefills[True]) < sum(r * w for r, w in prefills[False]) * 0.7


def test_the_static_decode_loop_prefills_every_turn_to_the_same_trajectories(tokenizer):
    torch.manual_seed(0)
    model = load_causal_lm(str(TINY_MODEL))
    greedy = GenerationConfig(max_new_tokens=5, do_sample=False)
    static = GenerationConfig(max_new_tokens=5, do_sample=False, kv_cache="static", prompt_bucket=8)
    engine = RolloutEngine(static, eos_token_ids=[EOS], pad_token_id=PAD)
    prefill = multi_turn_rollout(Uneven, MultiTurnConfig(max_turns=3, cache_across_turns=False), tokenizer=tokenizer,
                                 generation=static, engine=engine, eos_token_ids=[EOS], pad_token_id=PAD)
    assert torch.equal(prefill.rollout(model, ROWS).input_ids, _rollouts(tokenizer, greedy)[True].rollout(model, ROWS).input_ids)


def test_sampling_with_the_cache_draws_what_prefill_draws_under_one_seed(tokenizer):
    model = load_causal_lm(str(TINY_MODEL))
    exps = {}
    for cached, rollout in _rollouts(tokenizer, GenerationConfig(max_new_tokens=5)).items():
        torch.manual_seed(1)
        exps[cached] = rollout.rollout(model, ROWS)
    assert torch.equal(exps[True].input_ids, exps[False].input_ids)


def test_a_rank_whose_trajectories_ended_keeps_stepping_with_the_others(monkeypatch, tokenizer):
    from lightning_mem.rl.turn_sampling import CachedTurns

    calls = []
    model = load_causal_lm(str(TINY_MODEL))
    monkeypatch.setattr(model, "generate", lambda **kw: calls.append((tuple(kw["input_ids"].shape), kw["synced_gpus"])))
    sampler = CachedTurns(GenerationConfig(), eos_token_ids=[EOS], pad_token_id=PAD)
    assert sampler.sample(model, [], [], 4, synced=True) == [] and calls == [((1, 1), True)]
    assert sampler.sample(model, [], [], 4, synced=False) == [] and len(calls) == 1
