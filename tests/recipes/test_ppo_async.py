"""Separate placement (a generator process of its own) in the PPO recipe, on CPU over gloo: with
``max_staleness: 0`` it is the colocated run step for step; with a generator faster or slower than
the trainer no trained sample is older than the bound, and the versions the trainer records are
those the generator sampled under; a generator that dies ends the run with one line, in time; a
resume says how it rebuilt the queue; and bad settings fail before any model loads."""

from __future__ import annotations

import time

import pytest
import torch
from lightning.pytorch import Callback

import recipes.ppo as ppo
from lightning_mem.rl.async_config import AsyncRolloutConfig
from lightning_mem.rl.engine_config import RolloutEngineConfig
from lightning_mem.rl.rollout_link import LinkLost
from tests.helpers import read_metric
from tests.recipes.test_ppo import _cli, fit, no_model_load  # noqa: F401 (a fixture)

SEPARATE = RolloutEngineConfig(placement="separate")


class TracedModule(ppo.PPOModule):
    """The recipe, with the generator slowed down (``delay_s``) and tracing what it sampled under which
    version, and the trainer recording the versions it trained on."""

    delay_s = 0.0
    trace_path: str | None = None

    def generator_spec(self):
        spec = super().generator_spec()
        spec.delay_s, spec.trace_path = self.delay_s, self.trace_path
        return spec

    def _separate_rollout(self, batch):
        exp = super()._separate_rollout(batch)
        self.trained = getattr(self, "trained", [])
        self.trained.append((self.iteration, exp.versions.tolist()))
        return exp


class SlowTrainer(Callback):
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        time.sleep(self.seconds)


def async_config(k: int, **kw) -> AsyncRolloutConfig:
    # Every wait between trainer and generator is bounded by timeout_s: the tests' hang guard,
    # several times a step of a loaded run.
    return AsyncRolloutConfig(max_staleness=k, timeout_s=kw.pop("timeout_s", 120), cpu_threads=1, **kw)


def _losses(root):
    return read_metric(root, "policy_loss"), read_metric(root, "value_loss"), read_metric(root, "reward_mean")


def test_max_staleness_0_separate_is_the_colocated_run_step_for_step(tmp_path):
    steps, batch = 2, 4  # step 1 samples under the weights step 0 sent
    fit(tmp_path / "colocated", steps=steps, batch_size=batch)
    module, _ = fit(tmp_path / "separate", steps=steps, batch_size=batch, rollout_engine=SEPARATE, async_rollout=async_config(0))
    colocated, separate = _losses(tmp_path / "colocated"), _losses(tmp_path / "separate")
    for ours, theirs in zip(separate, colocated):
        assert sorted(ours) == sorted(theirs) == list(range(steps))
        for step in range(steps):
            assert ours[step] == pytest.approx(theirs[step], abs=1e-6), (step, ours, theirs)
    # Lockstep: every batch sampled under the weights it trained with.
    assert read_metric(tmp_path / "separate", "async/staleness_0") == {s: float(batch) for s in range(steps)}
    assert module.async_rollouts.client.process.exitcode == 0  # stopped, not killed


class BaselineProbe(ppo.PPOModule):
    """The recipe, recording each step's greedy answers (ReMax's baseline) and their scores."""

    def score(self, exp):
        super().score(exp)
        self.baselines = getattr(self, "baselines", [])
        self.baselines.append((list(exp.baseline_responses), exp.baseline_scores.tolist()))


def test_remax_at_max_staleness_0_separate_is_the_colocated_run_step_for_step(tmp_path):
    """ReMax: the generator decodes each prompt's greedy answer beside the request's samples, under the
    same weights. In lockstep the run is the colocated one: the same greedy answers, the same baseline
    scores, the same losses. Scores that vary (the answers' length) and large steps (lr 1e-2): a
    baseline decoded under stale weights would differ at step 1."""
    import torch

    from tests.rl.test_vllm_engine import LengthReward

    steps, batch = 2, 4
    remax = dict(module_cls=BaselineProbe, steps=steps, batch_size=batch, advantage_estimator="remax",
                 reward=LengthReward(), optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2))
    colocated, _ = fit(tmp_path / "colocated", **remax)
    separate, _ = fit(tmp_path / "separate", rollout_engine=SEPARATE, async_rollout=async_config(0), **remax)
    assert len(separate.baselines) == steps and all(len(answers) == batch for answers, _ in separate.baselines)
    assert separate.baselines == colocated.baselines  # the greedy answers and their scores, step by step
    assert any(score for _, scores in separate.baselines for score in scores)  # not all empty answers
    for name in ("policy_loss", "reward_mean", "baseline_reward_mean"):
        ours, theirs = read_metric(tmp_path / "separate", name), read_metric(tmp_path / "colocated", name)
        assert sorted(ours) == sorted(theirs) == list(range(steps)), name
        for step in range(steps):
            assert ours[step] == pytest.approx(theirs[step], abs=1e-6), (name, step, ours, theirs)
    assert read_metric(tmp_path / "separate", "async/staleness_0") == {s: float(batch) for s in range(steps)}
    assert separate.async_rollouts.client.process.exitcode == 0


@pytest.mark.parametrize("faster", ["generator", "trainer"])
def test_no_trained_sample_is_older_than_k_and_versions_are_those_sampled_under(tmp_path, faster):
    k, steps = 2, 4
    TracedModule.trace_path = str(tmp_path / "trace.txt")
    TracedModule.delay_s = 1.0 if faster == "trainer" else 0.0
    callbacks = [SlowTrainer(1.0)] if faster == "generator" else []
    module, trainer = fit_with(tmp_path, callbacks, module_cls=TracedModule, steps=steps, rollout_engine=SEPARATE,
                               async_rollout=async_config(k))
    sampled = dict(tuple(int(x) for x in line.split()) for line in (tmp_path / "trace.txt").read_text().splitlines())
    assert [it for it, _ in module.trained] == list(range(steps))
    for iteration, versions in module.trained:
        assert set(versions) == {sampled[iteration]}  # the trainer's tag is the generator's version
        assert 0 <= iteration - sampled[iteration] <= k
    hist = {j: read_metric(tmp_path, f"async/staleness_{j}") for j in range(k + 1)}
    assert all(sum(h.get(s, 0) for h in hist.values()) == 8 for s in range(steps))  # every sample in the histogram
    assert set(read_metric(tmp_path, "async/dropped").values()) == {0.0}
    if faster == "generator":  # it runs ahead as far as the bound lets it
        assert max(it - sampled[it] for it, _ in module.trained) == k


def fit_with(tmp_path, callbacks, **kwargs):
    original = ppo.PPOModule.configure_callbacks

    def with_extra(self):
        return original(self) + callbacks

    TracedModule.configure_callbacks = with_extra
    try:
        return fit(tmp_path, **kwargs)
    finally:
        del TracedModule.configure_callbacks


class KillGenerator(Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch_idx == 0:
            module.async_rollouts.client.process.kill()
            module.killed_at = time.monotonic()


def test_a_killed_generator_ends_the_run_with_one_line_within_the_timeout(tmp_path):
    timeout = 30.0
    with pytest.raises(LinkLost) as err:
        fit_with(tmp_path, [KillGenerator()], module_cls=TracedModule, steps=3, rollout_engine=SEPARATE,
                 async_rollout=async_config(1, timeout_s=timeout))
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("async rollout: the generator process (pid ") and "exited with code -9" in message
    # Noticed at the next send or receive, not after the timeout.
    assert time.monotonic() - _last_module().killed_at < timeout


def _last_module():
    import gc

    return next(o for o in gc.get_objects() if isinstance(o, TracedModule) and hasattr(o, "killed_at"))


def test_a_hung_generator_ends_the_run_within_the_timeout(tmp_path):
    timeout = 8.0
    TracedModule.delay_s, TracedModule.trace_path = 3600.0, None
    start = time.monotonic()
    with pytest.raises(LinkLost, match=r"async rollout: the generator process \(pid \d+, still running\) failed while"
                                       r" waiting for samples: timed out .*timeout 8s\)$"):
        fit(tmp_path, module_cls=TracedModule, steps=2, rollout_engine=SEPARATE, async_rollout=async_config(0, timeout_s=timeout))
    assert time.monotonic() - start < 120  # start-up + one timeout, not the hour it sleeps


def test_async_settings_fail_before_any_model_loads(tmp_path, no_model_load):
    with pytest.raises(ValueError, match=r"`model.async_rollout.weight_sync_steps`=3 with `model.async_rollout.max_staleness`=1"):
        _cli(tmp_path, "--model.rollout_engine.placement=separate", "--model.async_rollout.weight_sync_steps=3")
    # ReMax in separate placement works (the generator samples its greedy baseline); sampling nothing
    # but greedy answers stays refused there as anywhere.
    with pytest.raises(ValueError, match=r"^`model.generation.do_sample: false` with `model.advantage_estimator: remax`"):
        _cli(tmp_path, "--model.rollout_engine.placement=separate", "--model.advantage_estimator=remax",
             "--model.generation.do_sample=false")
    with pytest.raises(ValueError, match=r"`model.rollout_engine.tensor_parallel_size`=2 with `model.rollout_engine.placement:"
                                         r" separate`: each generator holds its copy on one device"):
        _cli(tmp_path, "--model.rollout_engine.placement=separate", "--model.rollout_engine.name=vllm",
             "--model.rollout_engine.tensor_parallel_size=2")
    with pytest.raises(SystemExit):
        _cli(tmp_path, "--model.rollout_engine.placement=elsewhere")
    with pytest.raises(SystemExit):
        _cli(tmp_path, "--model.async_rollout.max_staleness=-1")
    with pytest.raises(SystemExit):
        _cli(tmp_path, "--model.async_rollout.late_policy=requeue")


# -- the shipped config, and resume ---------------------------------------------------------------------

ASYNC_CONFIG = "configs/ppo/tiny_cpu_async.yaml"


def _async_cli(root, *extra):
    from tests.helpers import REPO, TINY_MODEL, csv_logger_args, run_recipe

    prompts = root.parent / "prompts.jsonl"
    if not prompts.exists():  # 16 prompts: 4 iterations an epoch at batch 4
        from tests.helpers import ARITH

        prompts.write_text("".join((ARITH / "prompts.jsonl").read_text().splitlines(keepends=True)[:16]))
    run = run_recipe(
        "ppo", "fit", "--config", str(REPO / ASYNC_CONFIG), f"--trainer.default_root_dir={root}",
        f"--model.name_or_path={TINY_MODEL}", *csv_logger_args(root), f"--data.train_file={prompts}",
        "--data.batch_size=4", "--model.grpo.group_size=4", "--checkpoint.every_n_train_steps=4",
        "--model.export_dir=null", "--trainer.enable_progress_bar=false", "--model.async_rollout.timeout_s=300",
        *extra, timeout=900,  # hang guard: several times a loaded run; every link wait is bounded anyway
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run


@pytest.mark.slow  # two CLI runs with a generator each: 3-4 min on the shared 2 cores
def test_the_async_config_resumes_with_its_version_counter_and_says_it_rebuilt_the_queue(tmp_path):
    """configs/ppo/tiny_cpu_async.yaml (1 + 1 processes, max_staleness 1): 2 iterations and a
    checkpoint, then ``--ckpt_path last`` to 3. A GRPO iteration is 2 optimizer steps here."""
    root = tmp_path / "run"
    first = _async_cli(root, "--trainer.max_steps=4")
    assert "the TIS rollout correction is on" in first.stderr + first.stdout
    ckpt = torch.load(next(root.rglob("last.ckpt")), weights_only=False)
    assert ckpt["async_rollout"] == {"version": 2}
    resumed = _async_cli(root, "--trainer.max_steps=6", "--ckpt_path=last")
    said = resumed.stderr + resumed.stdout
    assert "async rollout: resumed at weight version 2; the generator starts empty and its queue is rebuilt" in said
    assert "batch(es) asked for ahead are drained unused" in said
    versions = read_metric(root, "async/sampled_version")
    assert sorted(versions) == [0, 1, 2]
    assert all(0 <= step - v <= 1 for step, v in versions.items())
    assert versions[2] == 2  # the resumed generator's first batch: the checkpoint's weights


@pytest.mark.slow
def test_two_training_ranks_and_one_generator_do_not_deadlock_over_20_weight_syncs(tmp_path):
    """DDP on 2 gloo ranks + the generator (3 processes), max_staleness 1: 20 iterations, so 20 weight
    syncs from rank 0 while rank 1's requests interleave; every batch within the bound on both ranks."""
    root = tmp_path / "run"
    _async_cli(root, "--trainer.devices=2", "--trainer.strategy=ddp", "--trainer.max_steps=40", "--trainer.max_epochs=20",
               "--checkpoint.every_n_train_steps=1000")
    versions = read_metric(root, "async/sampled_version")  # rank 0's
    assert sorted(versions) == list(range(20))
    assert all(0 <= step - v <= 1 for step, v in versions.items())
    hist = [read_metric(root, f"async/staleness_{j}") for j in (0, 1)]
    assert all(hist[0][s] + hist[1][s] == 2 * 16 for s in range(20))  # both ranks' samples, summed


def test_the_default_correction_of_separate_placement_leaves_the_shared_defaults_alone():
    """``ppo``'s default is one object for every module built in a process: separate placement's TIS
    goes into a copy, so a colocated module built afterwards still has none (and no error)."""
    from recipes.rewards import ArithmeticReward
    from tests.helpers import TINY_MODEL

    separate = ppo.PPOModule(name_or_path=str(TINY_MODEL), reward=ArithmeticReward(), rollout_engine=SEPARATE)
    colocated = ppo.PPOModule(name_or_path=str(TINY_MODEL), reward=ArithmeticReward())
    assert separate.ppo.rollout_correction.mode == "tis"
    assert colocated.ppo.rollout_correction.mode == "none"


def test_fsdp2_training_ranks_gather_before_rank_0_sends_to_two_generators(tmp_path):
    """FSDP2 over 2 gloo ranks, 2 generator processes (each serving one rank), ``max_staleness: 0``:
    every rank gathers the DTensor shards collectively and rank 0 sends the whole weights to both
    generators. Sampling in lockstep under the weights just trained, each generator's behaviour
    log-probs equal the trainer's old log-probs (``mismatch_kl``, summed over both ranks, ~0) after
    every sync; a generator left with older or partial weights would be off by far more at this
    learning rate (0.01)."""
    root = tmp_path / "run"
    _async_cli(root, "--trainer.devices=2", "--trainer.strategy=lightning_mem.strategies.FSDP2Strategy",
               "--trainer.strategy.init_args.process_group_backend=gloo", "--model.async_rollout.generator_devices=2",
               "--model.async_rollout.max_staleness=0", "--model.optimizer.init_args.lr=0.01", "--trainer.max_steps=6",
               "--checkpoint.every_n_train_steps=1000")
    mismatch = read_metric(root, "mismatch_kl")
    assert sorted(mismatch) == [0, 1, 2]
    assert all(abs(v) < 1e-6 for v in mismatch.values()), mismatch
    assert read_metric(root, "async/sampled_version") == {0: 0.0, 1: 1.0, 2: 2.0}
