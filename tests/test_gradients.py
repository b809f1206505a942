"""Gradients are freed right after the optimizer step (lightning_mem.gradients), in the SFT recipe
through its real CLI: none is alive when a step's forward starts, accumulation keeps them until
the step, and the weights are those of the loop that freed them at the next step's zero_grad.
PPO's hand-stepped optimizers free theirs before the next rollout, scoring pass and mini-batch."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback, LightningModule

from lightning_mem.cli import RecipeCLI
from lightning_mem.data import SFTDataModule
from recipes.sft import SFTModule
from tests.helpers import REPO

CONFIG = str(REPO / "configs" / "sft" / "tiny_cpu.yaml")


class GradientProbe(Callback):
    """Records, as each training batch starts, whether any trainable parameter holds a gradient."""

    def __init__(self) -> None:
        self.alive: list[tuple[int, int]] = []  # (batch index, parameters with a gradient)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        held = sum(p.grad is not None for p in pl_module.parameters() if p.requires_grad)
        self.alive.append((batch_idx, held))


class GradientsUntilNextForward(SFTModule):
    """The recipe with Lightning's own gradient lifetime (zeroed in the next step's closure)."""

    def optimizer_step(self, *args, **kwargs) -> None:
        LightningModule.optimizer_step(self, *args, **kwargs)


def _fit(tmp_path, module_class=SFTModule, *extra: str) -> tuple[RecipeCLI, GradientProbe]:
    args = [
        "fit", "--config", CONFIG, f"--trainer.default_root_dir={tmp_path}", "--trainer.max_steps=4",
        "--trainer.val_check_interval=null", "--trainer.limit_val_batches=0", "--trainer.logger=false",
        "--trainer.enable_progress_bar=false",
        "--model.export_dir=null", "--model.lr_scheduler.init_args.warmup_steps=1",
        "--data.max_tokens_per_batch=256", "--trainer.callbacks=tests.test_gradients.GradientProbe", *extra,
    ]  # fmt: skip
    cli = RecipeCLI(module_class, SFTDataModule, args=args, save_config_kwargs={"overwrite": True})
    # By name: the CLI imports this file as a module of its own, beside pytest's import of it.
    (probe,) = [cb for cb in cli.trainer.callbacks if type(cb).__name__ == "GradientProbe"]
    return cli, probe


@pytest.mark.parametrize("extra", [[], ["--trainer.callbacks+=lightning_mem.callbacks.OptimizerStateOffload"]],
                         ids=["plain", "optimizer_state_offload"])
def test_no_gradient_alive_when_a_step_starts(tmp_path, extra):
    _, probe = _fit(tmp_path, SFTModule, *extra)
    assert [held for _, held in probe.alive] == [0, 0, 0, 0]


def test_accumulation_keeps_gradients_until_the_step(tmp_path):
    cli, probe = _fit(tmp_path, SFTModule, "--trainer.accumulate_grad_batches=2")
    trainable = sum(p.requires_grad for p in cli.model.parameters())
    # Micro-batches 0, 2, 4, 6 start optimizer steps; 1, 3, 5, 7 run next to their step's gradients.
    assert probe.alive == [(i, 0 if i % 2 == 0 else trainable) for i in range(8)]


def test_lightning_default_keeps_them_through_the_forward(tmp_path):
    # What the mixin changes: without it, from the second step on, every gradient is alive.
    cli, probe = _fit(tmp_path, GradientsUntilNextForward)
    trainable = sum(p.requires_grad for p in cli.model.parameters())
    assert [held for _, held in probe.alive] == [0, trainable, trainable, trainable]


def test_freeing_changes_no_weight(tmp_path):
    freed, _ = _fit(tmp_path / "a", SFTModule)
    kept, _ = _fit(tmp_path / "b", GradientsUntilNextForward)
    for (name, a), (_, b) in zip(freed.model.named_parameters(), kept.model.named_parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)


def test_tracked_bytes_no_gradient_in_the_forward(tmp_path):
    """Exact tracked bytes of the real fit (lightning_mem.estimate.measure_fit): with gradients freed
    after the step, a step peaks in its backward with this step's gradients only; with Lightning's
    default lifetime the last step's gradients sit beside the forward's activations too."""
    import json

    from lightning_mem.estimate import measure_fit

    rows = tmp_path / "rows.jsonl"  # rows that fill max_length: every micro-batch is 4 x 64 tokens
    rows.write_text("".join(json.dumps({"prompt": "1+1", "completion": "x" * 120}) + "\n" for _ in range(32)))
    overrides = [f"--data.train_file={rows}", "--data.val_file=null", "--data.max_tokens_per_batch=256"]
    (freed,), = measure_fit(CONFIG, overrides, steps=3)
    (kept,), = measure_fit(CONFIG, overrides, steps=3, recipe="tests.test_gradients")
    params = 3_059_456 * 4
    assert freed.device_breakdown_bytes["gradients"] < params  # only part of this step's, in backward
    assert kept.device_breakdown_bytes["gradients"] >= params  # every gradient, at the forward's peak
    assert kept.device_peak_bytes - freed.device_peak_bytes >= 0.5 * params


def test_ppo_frees_them_before_each_rollout_score_and_mini_batch(tmp_path):
    """PPO steps its optimizers by hand, several times per iteration (ppo_epochs x mini-batches, an
    actor and a critic): no gradient element of the last update is alive when the next rollout,
    scoring pass or mini-batch's first forward starts."""
    from lightning.pytorch import Trainer, seed_everything

    import recipes.ppo as ppo
    from lightning_mem.data import PromptDataModule
    from lightning_mem.rl.config import PPOConfig
    from lightning_mem.rl.rollout import GenerationConfig
    from recipes.rewards import ArithmeticReward
    from tests.helpers import ARITH, TINY_MODEL

    class Probe(ppo.PPOModule):
        seen: list

        def _live(self) -> int:
            return sum(p.grad.numel() for p in self.parameters() if p.grad is not None)

        def rollout(self, batch):
            self.seen.append(("rollout", self._live()))
            return super().rollout(batch)

        def score(self, exp):
            self.seen.append(("score", self._live()))
            return super().score(exp)

        def update(self, exp):
            self.first_of_mini_batch = True
            return super().update(exp)

        def loss(self, mb):
            self.forwards += 1
            if self.first_of_mini_batch:
                self.seen.append(("update", self._live()))
            self.first_of_mini_batch = False
            return super().loss(mb)

        def _optimizer_step(self):
            self.seen.append(("step", self._live()))
            super()._optimizer_step()
            self.first_of_mini_batch = True

    seed_everything(0)
    module = Probe(
        name_or_path=str(TINY_MODEL), reward=ArithmeticReward(), generation=GenerationConfig(max_new_tokens=4),
        ppo=PPOConfig(ppo_epochs=2, num_mini_batches=2, max_tokens_per_microbatch=32), export_dir=None,  # 2+ micro-batches
    )  # fmt: skip
    module.seen, module.forwards = [], 0
    data = PromptDataModule(str(ARITH / "prompts.jsonl"), tokenizer=str(TINY_MODEL), batch_size=8, max_prompt_length=64)
    Trainer(accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=2, default_root_dir=tmp_path, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(module, data)
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)  # actor + critic
    per_iteration = ["rollout", "score"] + ["update", "step"] * 4
    assert [phase for phase, _ in module.seen] == per_iteration * 2
    # Each optimizer step sees every trainable gradient (accumulated over its micro-batches) ...
    assert [live for phase, live in module.seen if phase == "step"] == [trainable] * 8
    assert module.forwards > 8  # some mini-batches accumulated over micro-batches
    # ... and every forward that starts afterwards sees none.
    assert all(live == 0 for phase, live in module.seen if phase != "step"), module.seen
