"""The PPO recipe with an environment (multi-turn rollouts): a one-turn environment learns exactly
what the single-turn recipe learns; the tiny multi-turn config and a tool environment run through
the real CLI; what cannot work with an environment fails before any model loads, naming its key;
and (slow) the multi-turn demo raises its reward."""

from __future__ import annotations

import re

import pytest
import torch

import recipes.ppo as ppo
from lightning_mem.rl.config import GRPOConfig, KLConfig
from lightning_mem.rl.environments import Environment, RewardEnvironment, Step
from lightning_mem.rl.multi_turn import FAULTS
from recipes.environments import ArithmeticRetry
from recipes.rewards import ArithmeticReward
from tests.helpers import REPO, TINY_MODEL, csv_logger_args, read_metric, run_recipe
from tests.recipes.test_ppo import _quarters, fit, no_model_load  # noqa: F401  (fixtures; sft_export: tests/conftest.py)
from tests.recipes.test_tiny_configs import ALLOWED, _warning_lines

CONFIG = str(REPO / "configs/ppo/tiny_cpu_multi_turn.yaml")
COMPARED = ("policy_loss", "value_loss", "kl", "entropy", "approx_kl", "clipfrac", "reward_mean", "response_length")


@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_a_one_turn_environment_learns_what_the_single_turn_recipe_learns(tmp_path, estimator):
    """Same prompts, same samples, same scores: every loss and metric of each step, and the weights."""
    options = dict(kl=KLConfig(coef=0.05))
    if estimator == "grpo":
        options = dict(advantage_estimator="grpo", grpo=GRPOConfig(group_size=4),
                       kl=KLConfig(coef=0.02, estimator="k3", in_reward=False))
    single, _ = fit(tmp_path / "single", steps=2, batch_size=4, **options)
    multi, _ = fit(tmp_path / "multi", steps=2, batch_size=4, reward=None,
                   environment=lambda: RewardEnvironment(ArithmeticReward()), **options)
    for name in COMPARED:
        want, got = read_metric(tmp_path / "single", name), read_metric(tmp_path / "multi", name)
        if name == "value_loss" and estimator == "grpo":
            assert want == got == {}
            continue
        assert len(want) == 2 and want.keys() == got.keys(), name
        for step in want:
            assert got[step] == pytest.approx(want[step], abs=1e-6), (name, step)
    assert read_metric(tmp_path / "multi", "multi_turn/turns_mean") == {0: 1.0, 1: 1.0}
    for (name, a), (_, b) in zip(single.actor.named_parameters(), multi.actor.named_parameters()):
        assert torch.allclose(a, b, atol=1e-6, rtol=0), name


def test_a_separate_generator_at_max_staleness_0_runs_the_colocated_trajectories_step_for_step(tmp_path):
    """The generator process runs the trajectory loop against its own environments (the rows travel
    with the prompts; scores, masks and counts come back with the samples): in lockstep it draws the
    colocated run's trajectories, so every loss and count of every step is the colocated run's."""
    from lightning_mem.rl.engine_config import RolloutEngineConfig
    from tests.recipes.test_ppo_async import async_config

    # The class is the factory (a lambda would not cross to the generator process).
    options = dict(steps=2, batch_size=4, reward=None, environment=ArithmeticRetry, kl=KLConfig(coef=0.05))
    fit(tmp_path / "colocated", **options)
    module, _ = fit(tmp_path / "separate", rollout_engine=RolloutEngineConfig(placement="separate"),
                    async_rollout=async_config(0), **options)
    names = (*COMPARED, "multi_turn/turns_mean", "multi_turn/observation_tokens_mean", "multi_turn/solved_on_retry")
    for name in names:
        want, got = read_metric(tmp_path / "colocated", name), read_metric(tmp_path / "separate", name)
        assert sorted(want) == sorted(got) == [0, 1], name
        for step in want:
            assert got[step] == pytest.approx(want[step], abs=1e-6), (name, step)
    assert read_metric(tmp_path / "separate", "multi_turn/turns_mean")[0] > 1  # second tries were taken
    assert read_metric(tmp_path / "separate", "async/staleness_0") == {0: 4.0, 1: 4.0}
    assert module.async_rollouts.client.process.exitcode == 0  # stopped, not killed


# -- the real CLI ---------------------------------------------------------------------------------


def _run(root, *extra, config=CONFIG):
    run = run_recipe("ppo", "fit", "--config", config, f"--trainer.default_root_dir={root}",
                     f"--model.name_or_path={TINY_MODEL}", "--trainer.enable_progress_bar=false", *csv_logger_args(root),
                     *extra)
    assert run.returncode == 0, run.stderr[-3000:]
    # No warning a user cannot act on (the tiny configs' rule, tests/recipes/test_tiny_configs.py).
    unexpected = [line for line in _warning_lines(run.stdout + run.stderr) if not any(re.search(a, line) for a in ALLOWED)]
    assert unexpected == [], "\n".join(unexpected)
    return root


@pytest.fixture(scope="module")
def multi_turn_run(tmp_path_factory):
    """The tiny multi-turn config's mechanics: two PPO iterations (8 optimizer steps each) of 4
    prompts, from the random tiny model (which answers wrong: every trajectory takes its second
    try); its own chat template given as a file."""
    return _run(tmp_path_factory.mktemp("multi_turn"), "--trainer.max_steps=16", "--data.batch_size=4",
                f"--model.multi_turn.chat_template={TINY_MODEL / 'chat_template.jinja'}")


def test_the_tiny_multi_turn_config_logs_turns_and_faults(multi_turn_run):
    assert read_metric(multi_turn_run, "multi_turn/turns_mean") == {0: 2.0, 1: 2.0}
    assert read_metric(multi_turn_run, "multi_turn/retries") == {0: 4.0, 1: 4.0}  # every first answer was wrong
    assert all(v > 0 for v in read_metric(multi_turn_run, "multi_turn/observation_tokens_mean").values())
    for name in FAULTS:
        assert read_metric(multi_turn_run, f"multi_turn/{name}") == {0: 0.0, 1: 0.0}, name
    # The response length counts the sampled tokens only: two turns of at most max_new_tokens (6).
    assert all(6 < v <= 12 for v in read_metric(multi_turn_run, "response_length").values())
    assert len(read_metric(multi_turn_run, "value_loss")) == 2  # GAE's critic trains on the sampled tokens
    assert (multi_turn_run / "export" / "model.safetensors").is_file()


def test_a_tool_environment_from_yaml_prefilling_every_turn(tmp_path):
    env = ('{"class_path": "lightning_mem.rl.tools.ToolEnvironment", "init_args": {"tools": ["recipes.tools.calculator"],'
           ' "reward": {"class_path": "recipes.rewards.ArithmeticReward", "init_args": {"extract": "last_integer"}},'
           ' "call_format": "hermes", "timeout_s": 5.0, "max_calls_per_turn": 2}}')
    root = _run(tmp_path, "--trainer.max_steps=1", "--data.batch_size=2", f"--model.environment={env}",
                "--model.multi_turn.max_turns=3", "--model.multi_turn.at_budget=score", "--model.multi_turn.max_total_tokens=96",
                "--model.multi_turn.step_timeout_s=30", "--model.multi_turn.cache_across_turns=false")
    assert read_metric(root, "multi_turn/turns_mean") == {0: 1.0}  # the random model calls no tool: one answer each
    assert read_metric(root, "multi_turn/tool_calls") == {0: 0.0}


class RankTurns(Environment):
    """Episodes of ``1 + 2 * rank`` turns: under two ranks, rank 0's trajectories all end after one
    turn while rank 1's run three."""

    def reset(self, row):
        import torch.distributed as dist

        self.turns, self.turn = 1 + 2 * (dist.get_rank() if dist.is_initialized() else 0), 0
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, message):
        self.turn += 1
        return Step([{"role": "user", "content": "Go on."}], 0.0, self.turn >= self.turns)


def test_fsdp2_ranks_whose_trajectories_end_at_different_turns_step_together(tmp_path):
    """Every forward of a sharded model is a collective: a rank whose trajectories have ended keeps
    stepping (a one-token dummy row) while the other samples, and nothing hangs."""
    root = _run(tmp_path, "--trainer.max_steps=8", "--data.batch_size=2", "--model.reward=null",
                "--model.environment.class_path=tests.recipes.test_ppo_multi_turn.RankTurns",
                "--model.multi_turn.max_turns=3", "--model.multi_turn.max_total_tokens=96",
                config=str(REPO / "configs" / "ppo" / "tiny_cpu_fsdp2.yaml"))
    assert read_metric(root, "multi_turn/turns_mean") == {0: 2.0}  # (2 x 1 + 2 x 3) / 4 trajectories


# -- bad settings: one line, before any model loads ----------------------------------------------------


def _cli(tmp_path, *extra):
    return ppo.main(["fit", "--config", CONFIG, f"--trainer.default_root_dir={tmp_path}", f"--model.name_or_path={TINY_MODEL}",
                     *extra])


DROPS_PAST_REASONING = (
    "{%- set ns = namespace(last=-1) %}{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last = loop.index0 %}"
    "{%- endif %}{%- endfor %}{%- for m in messages %}{%- set c = m.content %}{%- if m.role == 'assistant' and"
    " loop.index0 < ns.last and '</think>' in c %}{%- set c = c.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|' + m.role + '|>\\n' + c + '<|eos|>' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}"
    "{%- endif %}"
)


@pytest.mark.parametrize(("extra", "message"), [
    (["--model.reward.class_path=recipes.rewards.ExactAnswerReward"],
     r"^`model.environment` scores its own trajectories: leave `model.reward` and `model.reward_model` unset$"),
    (["--model.advantage_estimator=remax"], r"^`model.advantage_estimator`: `remax`'s greedy baseline is one greedy answer"),
    (["--model.generation.kv_cache=static"],
     r"^`model.multi_turn.cache_across_turns: true` continues Hugging Face generate's cache, but the static decode"
     r" loop \(`model.generation.kv_cache: static`\)"),
    (["--model.multi_turn.chat_template=no/such.jinja"], r"^`model.multi_turn.chat_template`: no file 'no/such.jinja'$"),
])
def test_settings_an_environment_cannot_work_with(tmp_path, no_model_load, extra, message):  # noqa: F811
    with pytest.raises(ValueError, match=message):
        _cli(tmp_path, *extra)


def test_a_template_that_is_not_prefix_preserving_is_refused_at_the_start(tmp_path, no_model_load):  # noqa: F811
    template = tmp_path / "rewrites.jinja"
    template.write_text(DROPS_PAST_REASONING)
    with pytest.raises(ValueError, match=r"^`model.multi_turn.chat_template`: the chat template is not prefix-preserving,"
                                         r" which multi-turn rollouts need \(rendering an observation changed"):
        _cli(tmp_path, f"--model.multi_turn.chat_template={template}")


def test_a_prompt_row_without_the_environments_key_fails_before_any_model(tmp_path, no_model_load):  # noqa: F811
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "1 + 1 =", "answer": "2"}\n{"prompt": "2 + 2 ="}\n')
    with pytest.raises(ValueError, match=r"prompts.jsonl:2: no `answer`, which the environment ArithmeticRetry needs"):
        _cli(tmp_path, f"--data.train_file={prompts}", "--data.batch_size=1")


# -- the demo -------------------------------------------------------------------------------------------


@pytest.mark.slow  # the target on the full config: 192 PPO steps (`pytest -m slow`; docs/ppo.md has the run)
def test_the_multi_turn_demo_raises_the_reward(tmp_path, sft_export):
    root = _run(tmp_path, f"--model.name_or_path={sft_export}")
    first, *_, last = _quarters(root)
    assert last >= first + 0.1, _quarters(root)
    assert sum(read_metric(root, "multi_turn/solved_on_retry").values()) > 0  # some second tries were right
