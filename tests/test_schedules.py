"""The learning-rate schedule spans the trainer's run and shortens a warmup longer than the run."""

from functools import partial
from types import SimpleNamespace

import pytest
import torch

from lightning_mem.schedules import WarmupCosineLR, build_lr_scheduler, check_schedule, scheduler_horizon


def _optimizer():
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)


def _trainer(max_steps=-1, max_epochs=None, batches=float("inf")):
    return SimpleNamespace(max_steps=max_steps, max_epochs=max_epochs, estimated_stepping_batches=batches)


def test_horizon_comes_from_max_steps_or_the_epochs():
    assert scheduler_horizon(_trainer(max_steps=50)) == 50
    assert scheduler_horizon(_trainer(max_epochs=3, batches=30)) == 30
    # PPO: 2 x 2 updates per batch of prompts; with a separate critic global_step counts both optimizers.
    assert scheduler_horizon(_trainer(max_epochs=2, batches=8), steps_per_batch=4, optimizers=2) == 32
    assert scheduler_horizon(_trainer(max_steps=64), steps_per_batch=4, optimizers=2) == 32
    with pytest.raises(ValueError, match="has no horizon"):
        scheduler_horizon(_trainer())


def test_schedule_without_total_steps_decays_over_the_run():
    factory = partial(WarmupCosineLR, warmup_steps=5, total_steps=None, min_lr_ratio=0.1)
    optimizer = _optimizer()
    scheduler = build_lr_scheduler(factory, optimizer, _trainer(max_steps=50))
    assert scheduler.total_steps == 50
    lrs = []
    for _ in range(50):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs[4] < lrs[5] == pytest.approx(1.0)  # warmup ends at the peak
    assert lrs[49] == pytest.approx(0.1, abs=2e-3)  # the last step is at the floor, not the peak


def test_explicit_total_steps_is_kept():
    factory = partial(WarmupCosineLR, warmup_steps=5, total_steps=20)
    assert build_lr_scheduler(factory, _optimizer(), _trainer(max_steps=50)).total_steps == 20


def test_warmup_longer_than_the_run_warns_naming_the_key_and_is_shortened(recwarn):
    factory = partial(WarmupCosineLR, warmup_steps=20, total_steps=None)
    with pytest.warns(UserWarning, match=r"`model.lr_scheduler.init_args.warmup_steps`=20 is longer than the run "
                                         r"\(10 scheduler steps, trainer.max_steps=10\): warming up over 10 steps"):
        check_schedule(factory, _trainer(max_steps=10), key="model.lr_scheduler")  # the key the recipes pass
    scheduler = build_lr_scheduler(factory, _optimizer(), _trainer(max_steps=10))
    assert (scheduler.warmup_steps, scheduler.total_steps) == (10, 10)
    # An explicit total_steps bounds the warmup too (the scheduler would refuse warmup > total).
    explicit = partial(WarmupCosineLR, warmup_steps=20, total_steps=8)
    assert build_lr_scheduler(explicit, _optimizer(), _trainer(max_steps=50)).warmup_steps == 8
    recwarn.clear()
    check_schedule(factory, _trainer(max_steps=20))  # fits: nothing to say
    assert not [w for w in recwarn if "warmup" in str(w.message)]
    assert build_lr_scheduler(factory, _optimizer(), _trainer(max_steps=20)).warmup_steps == 20


def test_total_steps_other_than_the_run_warns():
    factory = partial(WarmupCosineLR, warmup_steps=2, total_steps=600)
    with pytest.warns(UserWarning, match=r"total_steps`=600 but this run takes 50 scheduler steps"):
        check_schedule(factory, _trainer(max_steps=50))


def test_direct_construction_still_needs_total_steps():
    with pytest.raises(ValueError, match="needs `total_steps`"):
        WarmupCosineLR(_optimizer(), warmup_steps=1)


def test_resume_keeps_the_current_horizon():
    # A run stopped after 30 of 30 steps and resumed with max_steps=60 follows the 60-step schedule.
    short = build_lr_scheduler(partial(WarmupCosineLR, warmup_steps=5, total_steps=None), _optimizer(), _trainer(max_steps=30))
    for _ in range(30):
        short.optimizer.step()
        short.step()
    opt = _optimizer()
    long = build_lr_scheduler(partial(WarmupCosineLR, warmup_steps=5, total_steps=None), opt, _trainer(max_steps=60))
    long.load_state_dict(short.state_dict())
    assert long.total_steps == 60 and long.last_epoch == 30
    reference = WarmupCosineLR(_optimizer(), warmup_steps=5, total_steps=60)
    assert long.lr_lambdas[0](30) == reference.lr_lambdas[0](30)
