"""Multi-turn rollouts: the loop that runs a batch of trajectories against their environments.

Per rollout: one environment per row from the factory (``model.environment``), ``reset`` to the
first messages, then turns until every trajectory has ended: sample one assistant turn for every
running trajectory at once (:mod:`lightning_mem.rl.turn_sampling`), hand each its environment's
``step``, append each observation's ids (:mod:`lightning_mem.rl.trajectory`). The result is one
:class:`~lightning_mem.rl.rollout.Experience` whose response mask covers the sampled tokens only.

Budgets (``model.multi_turn``): ``max_turns`` assistant turns and ``max_total_tokens`` tokens
(prompt, turns and observations) per trajectory. A trajectory ends *at its budget* when its turns
run out before its environment says done, when a turn is cut by the token budget, or when an
observation does not fit with room for one more token (the observation is cut: not appended).
``at_budget`` decides what such a trajectory gets: ``mask`` keeps it out of the loss (its score
still counts in its group's statistics and the metrics), ``score`` trains on it as it stands, its
score the rewards it collected.

Faults, each counted per step (metrics ``multi_turn/<name>``), none of which stops the run:

- an environment whose ``reset`` or ``step`` raises (``env_errors``) or does not return within
  ``step_timeout_s`` (``env_timeouts``): the trajectory ends there and does not train (its score is
  what it had collected);
- an observation that does not fit (``observations_cut``) or a turn cut by the token budget
  (``turns_cut``): the trajectory ends at its budget;
- a rendering that is not a suffix of the conversation so far (``template_mismatch``): the
  trajectory ends there and does not train;
- a tool environment's own: unparsable calls, unknown tools, tools that raise or hang
  (:mod:`lightning_mem.rl.tools`), fed back to the policy as error observations.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from jsonargparse.typing import PositiveFloat, PositiveInt
from torch import Tensor

from lightning_mem.rl.environments import Environment, as_step
from lightning_mem.rl.rollout import Experience
from lightning_mem.rl.tools import Timeout, call_with_timeout, tool_schemas
from lightning_mem.rl.trajectory import ChatRenderer, PrefixError, Trajectory, experience_from_trajectories
from lightning_mem.rl.turn_sampling import device_of
from lightning_mem.settings import check_fields

#: Counts every rollout reports (each rank the same names: the step sums them over ranks).
FAULTS = ("env_errors", "env_timeouts", "observations_cut", "turns_cut", "template_mismatch", "prompts_over_budget")
#: Prefix of the multi-turn sums in an Experience's ``sample_stats`` and of their metrics.
PREFIX = "multi_turn/"


@dataclass
class MultiTurnConfig:
    """The trajectory budgets and the rendering (in the PPO recipe: ``model.multi_turn``).

    Args:
        max_turns: assistant turns per trajectory.
        max_total_tokens: tokens per trajectory: prompt, every turn, every observation.
        at_budget: what a trajectory ended by its budget gets: ``mask`` (no loss) or ``score``
            (trained as it stands).
        step_timeout_s: time limit of one environment call (``reset`` or ``step``); None: none.
        chat_template: a Jinja template file used instead of the tokenizer's own to render the
            conversation (it must be prefix-preserving: checked at the start).
        cache_across_turns: the ``hf`` engine continues its KV cache from turn to turn (each turn
            prefills only its new ids); false prefills each whole conversation every turn.
    """

    max_turns: PositiveInt = 4
    max_total_tokens: PositiveInt = 1024
    at_budget: Literal["mask", "score"] = "mask"
    step_timeout_s: PositiveFloat | None = 60.0
    chat_template: str | None = None
    cache_across_turns: bool = True

    def __post_init__(self) -> None:
        check_fields(self)


class MultiTurnRollout:
    """Runs trajectories of ``environment`` instances with a turn sampler (module docstring).

    ``counters``: the names of the counts the environments report (:meth:`Environment.metrics`),
    reported by every rollout (zeros included) so that every rank sums the same names.
    """

    def __init__(self, environment: Callable[[], Environment], config: MultiTurnConfig, renderer: ChatRenderer,
                 sampler: Any, *, max_new_tokens: int, eos_token_ids: list[int], pad_token_id: int,
                 counters: tuple[str, ...] = ()) -> None:
        self.environment, self.config, self.renderer, self.sampler = environment, config, renderer, sampler
        self.max_new_tokens, self.pad_token_id = max_new_tokens, pad_token_id
        self.end_ids = set(eos_token_ids)
        self.counters = tuple(dict.fromkeys((*FAULTS, *counters)))
        self._unknown_said = False

    def rollout(self, model: torch.nn.Module, rows: list[dict[str, Any]], *, synced: bool = False,
                agree_on_count: Callable[[int], int] | None = None) -> Experience:
        """One trajectory per row (rows repeat for a group), run to its end; their Experience."""
        trajectories = [self._begin(row) for row in rows]
        with self.sampler.session(model):
            while True:
                running = [i for i, t in enumerate(trajectories) if not t.done]
                count = agree_on_count(len(running)) if synced and agree_on_count is not None else len(running)
                if count == 0:
                    break
                room = max((self.config.max_total_tokens - trajectories[i].length for i in running), default=1)
                sampled = self.sampler.sample(model, running, [trajectories[i].pending for i in running],
                                              min(self.max_new_tokens, room), synced=synced)
                # The engine's log-probs of what it sampled, where it reports them (vLLM).
                logprobs = getattr(self.sampler, "last_logprobs", None) or [None] * len(sampled)
                for i, ids, lp in zip(running, sampled, logprobs):
                    self._turn(trajectories[i], ids, lp)
        device = device_of(model)
        exp = experience_from_trajectories(trajectories, pad_token_id=self.pad_token_id, device=device,
                                           mask_at_budget=self.config.at_budget == "mask")
        exp.prompts = [self.renderer.tokenizer.decode(t.prompt_ids, skip_special_tokens=True) for t in trajectories]
        exp.sample_stats.update(self._stats(trajectories, device))
        return exp

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return call_with_timeout(fn, self.config.step_timeout_s, *args)

    def _begin(self, row: dict[str, Any]) -> Trajectory:
        """A trajectory reset to its first messages; one whose environment fails starts ended."""
        env = self.environment()
        try:
            messages = list(self._call(env.reset, row))
            tools = tool_schemas(env.tools) if env.tools else None
            prompt = self.renderer.prompt_ids(messages, tools)
        except Exception as error:
            t = Trajectory(env, [], [self.pad_token_id], done=True, failed=True)
            t.add_count("env_timeouts" if isinstance(error, Timeout) else "env_errors")
            return t
        t = Trajectory(env, messages, prompt, tools=tools, pending=list(prompt))
        if len(prompt) >= self.config.max_total_tokens:  # no room for one sampled token
            t.done = t.failed = True
            t.add_count("prompts_over_budget")
        return t

    def _turn(self, t: Trajectory, ids: list[int], logprobs: list[float] | None = None) -> None:
        """Append one sampled turn (cut to the token budget) and hand it to the environment."""
        room = self.config.max_total_tokens - t.length
        ids = ids[:room]
        ended = bool(ids) and ids[-1] in self.end_ids
        cut = len(ids) == room and not ended  # the budget, not the end token, stopped it
        t.add_sampled(ids, logprobs)
        t.turns += 1
        t.last_answer = self.renderer.tokenizer.decode([i for i in ids if i not in self.end_ids],
                                                       skip_special_tokens=True)
        t.messages.append({"role": "assistant", "content": t.last_answer})
        if cut:
            t.add_count("turns_cut")
        self._step(t, ended=ended, cut=cut)

    def _step(self, t: Trajectory, *, ended: bool, cut: bool) -> None:
        """The environment's answer to the last turn: the episode ends (done, a budget, a fault), or
        its observation's ids are appended."""
        try:
            step = as_step(self._call(t.env.step, t.messages[-1]))
        except Exception as error:
            t.done = t.failed = True
            t.add_count("env_timeouts" if isinstance(error, Timeout) else "env_errors")
            return
        t.reward += step.reward
        if step.done or cut or t.turns >= self.config.max_turns:
            t.done, t.at_budget = True, not step.done or cut
            return
        try:
            observation = self.renderer.observation_ids(t.messages, step.observations, tools=t.tools, ended=ended)
        except PrefixError:
            t.done = t.failed = True
            t.add_count("template_mismatch")
            return
        if t.length + len(observation) >= self.config.max_total_tokens:  # no room left to answer it
            t.done = t.at_budget = True
            t.add_count("observations_cut")
            return
        t.messages += step.observations
        t.add_observation(observation)

    def _stats(self, trajectories: list[Trajectory], device: torch.device) -> dict[str, Tensor]:
        """The step's sums (float64): turns, observation tokens, trajectories at their budget, and
        every count of :attr:`counters`."""
        sums = dict.fromkeys(self.counters, 0.0)
        sums.update(turns=0.0, observation_tokens=0.0, at_budget=0.0)
        unknown = set()
        for t in trajectories:
            sums["turns"] += t.turns
            sums["observation_tokens"] += len(t.sampled) - sum(t.sampled)
            sums["at_budget"] += t.at_budget
            for name, n in {**t.counts, **(t.env.metrics() if t.env is not None else {})}.items():
                if name in sums:
                    sums[name] += n
                else:
                    unknown.add(name)
        if unknown and not self._unknown_said:
            warnings.warn(f"environment counts {sorted(unknown)} are not logged: name them in the environment's"
                          " `counters` (each rank must report the same names)", stacklevel=2)
            self._unknown_said = True
        return {PREFIX + k: torch.tensor(v, dtype=torch.float64, device=device) for k, v in sums.items()}


def trajectory_extras(exp: Experience) -> dict[str, Any]:
    """What a multi-turn Experience holds beyond its token tensors, as plain data: the scores, which
    trajectories train, the step's sums, the texts. Separate placement sends it back with the samples."""
    return {"scores": exp.scores.tolist(), "keep": exp.sample_keep.tolist(), "prompts": exp.prompts,
            "responses": exp.responses, "stats": {k: float(v) for k, v in exp.sample_stats.items()}}


def with_trajectory_extras(exp: Experience, extras: dict[str, Any]) -> Experience:
    """``exp`` (a generator's tensors) with :func:`trajectory_extras` back in place, exactly."""
    exp.scores = torch.tensor(extras["scores"], dtype=torch.float32)
    exp.sample_keep = torch.tensor(extras["keep"], dtype=torch.bool)
    exp.prompts, exp.responses = extras["prompts"], extras["responses"]
    exp.sample_stats.update({k: torch.tensor(v, dtype=torch.float64) for k, v in extras["stats"].items()})
    return exp


def trajectory_metrics(totals: dict[str, Tensor]) -> dict[str, Tensor]:
    """The step's multi-turn metrics from its sums over all ranks: turns and observation tokens per
    trajectory, the share that ended at its budget, and every count as it is."""
    if PREFIX + "turns" not in totals:
        return {}
    samples = totals["samples"]
    per_trajectory = ("turns", "observation_tokens")
    metrics = {f"{PREFIX}{name}_mean": totals[PREFIX + name] / samples for name in per_trajectory}
    metrics[f"{PREFIX}at_budget_frac"] = totals[PREFIX + "at_budget"] / samples
    metrics.update({name: value for name, value in totals.items() if name.startswith(PREFIX)
                    and name.removeprefix(PREFIX) not in (*per_trajectory, "at_budget")})
    return metrics


# ---------------------------------------------------------------------------------------------
# What a recipe calls: the checks before anything loads, and the rollout's construction
# ---------------------------------------------------------------------------------------------


def check_multi_turn(environment: Any, config: MultiTurnConfig, *, scored_otherwise: bool, advantage_estimator: str,
                     generation: Any) -> None:
    """Refuse the settings a multi-turn run cannot work with, named relative to the recipe's model
    section (``environment``, ``multi_turn.*``...); nothing when ``environment`` is None."""
    from lightning_mem.rl.advantages import GREEDY_BASELINE
    from lightning_mem.settings import SettingError, SettingNotSupported, SettingPathError

    if environment is None:
        return
    if not callable(environment):
        raise SettingError("environment", f" must make environments (a class_path), got {type(environment).__name__}")
    if scored_otherwise:
        raise SettingError("environment", "`environment` scores its own trajectories: leave `reward` and"
                           " `reward_model` unset", siblings=("reward", "reward_model"))
    if advantage_estimator in GREEDY_BASELINE:
        raise SettingNotSupported("advantage_estimator", f": `{advantage_estimator}`'s greedy baseline is one greedy"
                                  " answer, not yet a greedy trajectory: pick another estimator with `environment`")
    if generation.kv_cache == "static" and config.cache_across_turns:
        raise SettingError("multi_turn.cache_across_turns", "`multi_turn.cache_across_turns: true` continues Hugging Face"
                           " generate's cache, but the static decode loop (`generation.kv_cache: static`) lays out its"
                           " cache per call: set it to false (each turn prefills its conversation again), or"
                           " `generation.kv_cache: dynamic`", siblings=("generation.kv_cache",))
    if config.chat_template is not None and not Path(config.chat_template).is_file():
        raise SettingPathError("multi_turn.chat_template", f": no file {config.chat_template!r}")


def check_template(environment: Callable[[], Environment], config: MultiTurnConfig, tokenizer: Any) -> None:
    """The start's check that the chat template renders observations as suffixes (a
    :class:`~lightning_mem.settings.SettingError` naming ``multi_turn.chat_template`` when it is
    set, else ``name_or_path``, whose tokenizer's template it is)."""
    from lightning_mem.rl.trajectory import check_prefix_preserving

    probe = environment()
    tools = tool_schemas(probe.tools, key="environment.init_args.tools") if probe.tools else None
    key = "name_or_path" if config.chat_template is None else "multi_turn.chat_template"
    end = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    check_prefix_preserving(lambda: ChatRenderer(tokenizer, end_token_ids=end, chat_template=_template(config)),
                            observation_role=probe.observation_role, tools=tools, key=key)


def _template(config: MultiTurnConfig) -> str | None:
    return None if config.chat_template is None else Path(config.chat_template).read_text()


def environment_keys(environment: Callable[[], Environment] | None) -> Any:
    """A :class:`~lightning_mem.rl.reward.RewardFunction` whose required keys are the environment's
    (the recipe checks the prompt rows against it, as against a reward rule); None without one."""
    from lightning_mem.rl.reward import RewardFunction

    if environment is None:
        return None
    probe = environment()

    class _EnvironmentKeys(RewardFunction):
        described = f"the environment {type(probe).__name__}"

        def required_keys(self) -> list[str]:
            return list(probe.required_keys())

    return _EnvironmentKeys()


def multi_turn_rollout(environment: Callable[[], Environment], config: MultiTurnConfig, *, tokenizer: Any,
                       generation: Any, engine: Any, eos_token_ids: list[int], pad_token_id: int) -> MultiTurnRollout:
    """The rollout a recipe runs each step: the hf engine continuing its cache across turns
    (``cache_across_turns``), or ``engine``'s ``generate`` on each whole conversation every turn
    (vLLM: its token-id prompts, with its prefix cache on)."""
    from lightning_mem.rl.turn_sampling import CachedTurns, PrefillTurns

    if getattr(engine, "prefix_caching", None) is False and getattr(engine, "llm", None) is None:
        # Each turn's prompt is the previous turn's conversation and more: vLLM's prefix cache
        # prefills only the new ids. Every weight load empties it, so no KV outlives its weights.
        engine.prefix_caching = True

    renderer = ChatRenderer(tokenizer, end_token_ids=eos_token_ids, chat_template=_template(config))
    cached = config.cache_across_turns and engine.name == "hf" and generation.kv_cache == "dynamic"
    sampler = (CachedTurns(generation, eos_token_ids=eos_token_ids, pad_token_id=pad_token_id) if cached
               else PrefillTurns(engine))
    return MultiTurnRollout(environment, config, renderer, sampler, max_new_tokens=generation.max_new_tokens,
                            eos_token_ids=eos_token_ids, pad_token_id=pad_token_id, counters=environment().counters)
