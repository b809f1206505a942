import pytest
import torch

from lightning_mem.dtypes import resolve_dtype


def test_dtype_strings_from_yaml():
    assert resolve_dtype("bfloat16", key="x") is torch.bfloat16
    assert resolve_dtype("torch.float16", key="x") is torch.float16
    assert resolve_dtype("fp32", key="x") is torch.float32
    assert resolve_dtype(None, key="x") is None


def test_every_key_accepts_the_same_spellings():
    for name in ("bf16", "BF16", "torch.bfloat16", " bfloat16 "):
        assert resolve_dtype(name, key="model.dtype") is torch.bfloat16
    assert resolve_dtype("half", key="model.dtype") is torch.float16
    assert resolve_dtype("auto", key="param_dtype") is None
    assert resolve_dtype(torch.float64, key="x") is torch.float64


@pytest.mark.parametrize("value", ["float8", torch.int8, 3])
def test_a_bad_dtype_names_its_key(value):
    with pytest.raises(ValueError, match=r"`model.critic.dtype`: unknown dtype"):
        resolve_dtype(value, key="model.critic.dtype")


# ---------------------------------------------------------------------------------------------
# The rule (lightning_mem.dtypes.PrecisionDtypes.load_dtype) and what a real fit holds under it
# ---------------------------------------------------------------------------------------------

import json  # noqa: E402

from lightning.pytorch import Callback, Trainer, seed_everything  # noqa: E402

from lightning_mem.callbacks.training_dtypes import TrainingDtypes  # noqa: E402
from lightning_mem.cli import RecipeCLI  # noqa: E402
from lightning_mem.data import PromptDataModule, SFTDataModule  # noqa: E402
from lightning_mem.dtypes import dtype_name, precision_dtypes  # noqa: E402
from lightning_mem.optim import optimizer_state_bytes_by_dtype  # noqa: E402
from lightning_mem.settings import SettingError  # noqa: E402
from tests.helpers import ARITH, REPO, TINY_MODEL, bf16_checkpoint_folder  # noqa: E402

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


@pytest.mark.parametrize(
    ("precision", "trained", "frozen"),
    [("32-true", F32, F32), ("bf16-mixed", F32, BF16), ("16-mixed", F32, F16), ("bf16-true", BF16, BF16),
     ("16-true", F16, F16), ("32", F32, F32), ("bf16", F32, BF16)],
)
def test_what_each_role_loads_in_when_its_dtype_is_unset(precision, trained, frozen):
    dtypes = precision_dtypes(precision)
    assert dtypes.load_dtype(None, role="trained") is trained
    assert dtypes.load_dtype(None, role="frozen") is frozen


def test_a_frozen_model_keeps_an_explicit_dtype_unless_the_precision_casts_every_parameter():
    assert precision_dtypes("bf16-mixed").load_dtype("float32", role="frozen") is F32
    assert precision_dtypes("32-true").load_dtype("auto", role="frozen") == "auto"  # the checkpoint's own
    assert precision_dtypes("bf16-true").load_dtype("bf16", role="frozen") is BF16
    with pytest.raises(SettingError, match=r"`reward_model.dtype: float32` contradicts `trainer.precision: bf16-true`"):
        precision_dtypes("bf16-true").load_dtype("float32", role="frozen", key="reward_model.dtype",
                                                 precision_key="trainer.precision")


@pytest.mark.parametrize(
    ("precision", "value", "message"),
    [("bf16-mixed", "bfloat16", r"`dtype: bfloat16` contradicts `precision: bf16-mixed`.*fp32 master weights.*"
                                r"`precision: bf16-true`"),
     ("32-true", "float16", r"`dtype: float16` contradicts `precision: 32-true`.*`precision: 16-true`"),
     ("bf16-true", "float32", r"`dtype: float32` contradicts `precision: bf16-true`.*`precision: 32-true or bf16-mixed`"),
     ("bf16-mixed", "auto", r"`dtype: auto` asks for the checkpoint's dtype, but under `precision: bf16-mixed` trained"
                            r" parameters are float32")],
)
def test_a_trained_dtype_the_precision_contradicts_is_one_error_naming_both_keys(precision, value, message):
    with pytest.raises(SettingError, match=message):
        precision_dtypes(precision).load_dtype(value, role="trained")
    assert precision_dtypes(precision).load_dtype(precision_dtypes(precision).trained, role="trained")  # agreeing: fine


def test_a_precision_without_a_rule_names_its_key():
    with pytest.raises(SettingError, match=r"`trainer.precision`: 'transformer-engine' has no rule"):
        precision_dtypes("transformer-engine", key="trainer.precision")


class DtypeProbe(Callback):
    """What one optimizer step really held, in bytes by dtype: the trainable and frozen parameters
    per top-level submodule, the gradients each optimizer step consumed, the optimizer state."""

    def __init__(self) -> None:
        self.gradients: dict[torch.dtype, int] = {}
        self.held: dict | None = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.held is None:  # every optimizer of the first step (PPO's actor and critic)
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        self.gradients[p.grad.dtype] = self.gradients.get(p.grad.dtype, 0) + p.grad.nbytes

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        if self.held is not None:
            return
        held: dict = {"trained": {}, "frozen": {}, "optimizer_state": {}}
        for name, child in pl_module.named_children():
            for p in child.parameters():
                role = held["trained" if p.requires_grad else "frozen"].setdefault(name, {})
                role[p.dtype] = role.get(p.dtype, 0) + p.nbytes
        for optimizer in trainer.optimizers:
            for dtype, nbytes in optimizer_state_bytes_by_dtype(optimizer, scalars=False).items():
                held["optimizer_state"][dtype] = held["optimizer_state"].get(dtype, 0) + nbytes
        self.held = held


def _callback(trainer, cls):
    (found,) = [cb for cb in trainer.callbacks if type(cb).__name__ == cls.__name__]
    return found


@pytest.fixture(scope="module")
def bf16_folder(tmp_path_factory):
    """The tiny model with ``torch_dtype: bfloat16`` in its config, as every real checkpoint says."""
    return bf16_checkpoint_folder(tmp_path_factory.mktemp("ckpt") / "tiny-bf16")


def _sft_step(root, folder, precision, config="tiny_cpu.yaml", *extra):
    """One optimizer step of an SFT config through the recipe's CLI, as a user would run it."""
    from recipes.sft import SFTModule

    args = [
        "fit", "--config", str(REPO / "configs" / "sft" / config), f"--trainer.default_root_dir={root}",
        f"--trainer.precision={precision}", f"--model.name_or_path={folder}", "--trainer.max_steps=1",
        "--trainer.val_check_interval=null", "--trainer.limit_val_batches=0", "--trainer.logger=false",
        "--trainer.enable_progress_bar=false", "--model.export_dir=null",
        "--model.lr_scheduler.init_args.warmup_steps=1", "--data.max_tokens_per_batch=128",
        "--trainer.callbacks=tests.test_dtypes.DtypeProbe", *extra,
    ]  # fmt: skip
    cli = RecipeCLI(SFTModule, SFTDataModule, args=args, save_config_kwargs={"overwrite": True})
    probe = _callback(cli.trainer, DtypeProbe)
    return probe.held | {"gradients": probe.gradients, "line": _callback(cli.trainer, TrainingDtypes).report.line()}


#: Trainable parameters of the tiny Llama (full fine-tune) and of its r=16 all-linear adapters.
TINY_PARAMS, TINY_ADAPTER_PARAMS = 3_059_456, 295_936


@pytest.fixture(scope="module", params=["32-true", "bf16-mixed", "bf16-true"])
def sft_step(request, tmp_path_factory, bf16_folder):
    return request.param, _sft_step(tmp_path_factory.mktemp("sft"), bf16_folder, request.param)


def test_a_bf16_checkpoint_trains_in_what_the_precision_says(sft_step):
    """Exact bytes of one real step: float32 parameters, gradients and AdamW moments under 32-true
    and bf16-mixed (fp32 master weights, whatever the checkpoint's torch_dtype); all bf16 under bf16-true."""
    precision, held = sft_step
    width = 2 if precision == "bf16-true" else 4
    dtype = BF16 if precision == "bf16-true" else F32
    assert held["trained"] == {"model": {dtype: width * TINY_PARAMS}}
    assert held["frozen"] == {}
    assert held["gradients"] == {dtype: width * TINY_PARAMS}
    assert held["optimizer_state"] == {dtype: 2 * width * TINY_PARAMS}  # exp_avg and exp_avg_sq
    compute = "bfloat16" if precision.startswith("bf16") else "float32"
    assert held["line"].startswith(
        f"dtypes under precision {precision}: trainable parameters {dtype_name(dtype)} (3.06M), "
        f"gradients {dtype_name(dtype)}, optimizer state {dtype_name(dtype)} {2 * width * TINY_PARAMS / 2**20:.1f} MiB, "
        f"compute {compute}"
    ), held["line"]


def test_lora_adapters_train_fp32_on_a_base_frozen_in_the_compute_dtype(tmp_path, bf16_folder):
    held = _sft_step(tmp_path, bf16_folder, "bf16-mixed", "tiny_cpu_lora.yaml", f"--model.random_init_dir={tmp_path}/base")
    assert held["trained"] == {"model": {F32: 4 * TINY_ADAPTER_PARAMS}}
    assert held["frozen"] == {"model": {BF16: 2 * TINY_PARAMS}}
    assert held["gradients"] == {F32: 4 * TINY_ADAPTER_PARAMS}
    assert held["optimizer_state"] == {F32: 8 * TINY_ADAPTER_PARAMS}
    assert "frozen: model bfloat16 (3.06M; the compute dtype, to save memory)" in held["line"], held["line"]


def _ppo_step(root, folder, precision):
    """One PPO iteration (GAE, a separate critic, a frozen reference copy, a reward model) in-process."""
    import recipes.ppo as ppo
    from lightning_mem.rl.config import PPOConfig, RewardModelConfig
    from lightning_mem.rl.rollout import GenerationConfig

    seed_everything(0)
    module = ppo.PPOModule(
        name_or_path=str(folder), reward_model=RewardModelConfig(name_or_path=str(folder)),
        generation=GenerationConfig(max_new_tokens=4),
        ppo=PPOConfig(ppo_epochs=1, num_mini_batches=1, max_tokens_per_microbatch=256), export_dir=None,
    )  # fmt: skip
    data = PromptDataModule(str(ARITH / "prompts.jsonl"), tokenizer=str(TINY_MODEL), batch_size=4, max_prompt_length=64)
    probe = DtypeProbe()
    trainer = Trainer(
        accelerator="cpu", devices=1, precision=precision, max_steps=2, default_root_dir=root, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[probe],
    )  # fmt: skip
    trainer.fit(module, data)
    return probe.held | {"gradients": probe.gradients, "line": _callback(trainer, TrainingDtypes).report.line()}


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_ppo_roles_follow_the_rule(tmp_path, bf16_folder, precision):
    """Actor and critic train fp32 under bf16-mixed, the reference copy and the reward model are
    frozen in bf16; under bf16-true everything is bf16 (and the step's float32 buffers still work)."""
    held = _ppo_step(tmp_path, bf16_folder, precision)
    trained = BF16 if precision == "bf16-true" else F32
    width = trained.itemsize
    config = json.loads((TINY_MODEL / "config.json").read_text())
    backbone = TINY_PARAMS - config["vocab_size"] * config["hidden_size"]  # no lm_head
    critic = backbone + config["hidden_size"] + 1  # + a value head (with a bias)
    reward_model = backbone + config["hidden_size"]  # + a score head (no bias)
    assert held["trained"] == {"actor": {trained: width * TINY_PARAMS}, "critic": {trained: width * critic}}
    assert held["frozen"] == {"reference": {BF16: 2 * TINY_PARAMS}, "reward_model": {BF16: 2 * reward_model}}
    assert held["gradients"] == {trained: width * (TINY_PARAMS + critic)}
    assert held["optimizer_state"] == {trained: 2 * width * (TINY_PARAMS + critic)}
    assert f"dtypes under precision {precision}: trainable parameters {dtype_name(trained)}" in held["line"]


@pytest.mark.parametrize(
    ("recipe", "config", "extra", "message"),
    [("sft", "sft/tiny_cpu.yaml", ["--trainer.precision=bf16-mixed", "--model.dtype=bfloat16"],
      r"`model.dtype: bfloat16` contradicts `trainer.precision: bf16-mixed`.*`trainer.precision: bf16-true`"),
     ("ppo", "ppo/tiny_cpu.yaml", ["--trainer.precision=bf16-mixed", "--model.critic.dtype=bf16"],
      r"`model.critic.dtype: bfloat16` contradicts `trainer.precision: bf16-mixed`"),
     ("ppo", "ppo/tiny_cpu.yaml", ["--trainer.precision=bf16-true", "--model.reward=null",
                                   f"--model.reward_model.name_or_path={TINY_MODEL}", "--model.reward_model.dtype=fp32"],
      r"`model.reward_model.dtype: float32` contradicts `trainer.precision: bf16-true`, which casts every parameter")],
    ids=["sft", "ppo_critic", "ppo_reward_model"],
)
def test_a_contradicting_dtype_fails_before_any_model_loads(tmp_path, monkeypatch, recipe, config, extra, message):
    import importlib

    module = importlib.import_module(f"recipes.{recipe}")

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad dtype was reported")

    for loader in ("load_causal_lm", "load_value_model", "load_reward_model", "load_reward_models"):
        if hasattr(module, loader):
            monkeypatch.setattr(module, loader, refuse)
    with pytest.raises(SettingError, match=message):
        module.main(["fit", "--config", str(REPO / "configs" / config), f"--trainer.default_root_dir={tmp_path}",
                     f"--model.name_or_path={TINY_MODEL}", "--trainer.logger=false", *extra])


def test_observing_the_first_batch_leaves_every_layer_as_the_other_batches_run_it():
    """TrainingDtypes counts the compute dtypes of the first batch without a hook on any layer: a
    hooked output layer is called as a module where an unhooked one is multiplied in directly
    (lightning_mem.logits), so per-layer hooks made a run's first batch -- a resumed run's too --
    differ from the uninterrupted run in the last bits."""
    from collections import Counter

    import lightning.pytorch as pl
    import torch
    from torch import nn

    from lightning_mem.callbacks.training_dtypes import TrainingDtypes
    from lightning_mem.logits import chunked_logprobs, fusable

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.actor = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 37, bias=False))
            self.reference = nn.Linear(4, 4).requires_grad_(False)

    module, callback = Module(), TrainingDtypes()
    hidden, targets = torch.randn(5, 8), torch.tensor([0, 3, 36, 7, 7])
    before = chunked_logprobs(hidden, targets, module.actor[1])[0]
    callback.on_train_batch_start(None, module, None, 0)
    try:
        assert all(not (m._forward_hooks or m._forward_pre_hooks) for m in module.modules())
        assert fusable(module.actor[1])
        assert torch.equal(chunked_logprobs(hidden, targets, module.actor[1])[0], before)
        module.actor(torch.randn(2, 4))
        module.reference(torch.randn(2, 4))  # frozen: not counted
        assert callback._compute == Counter({torch.float32: 2 * 8 + 2 * 37})
        from lightning_mem import compile as regional

        assert regional._held()  # compiled blocks run eager while the hook watches
    finally:
        for hook in callback._hooks:
            hook.remove()
    # A hook removed by any path (here by hand, not by the callback) ends the hold with it: a leaked
    # hold would leave every compiled block of the process eager.
    assert not regional._held() and not regional._EAGER_HOLDS


def test_a_run_that_fails_in_its_first_batch_leaves_no_hook_and_no_eager_hold():
    """Lightning calls no ``teardown`` after an exception: the observer lets go in ``on_exception``."""
    import lightning.pytorch as pl
    import torch
    from torch import nn
    from torch.utils.data import DataLoader

    from lightning_mem import compile as regional
    from lightning_mem.callbacks.training_dtypes import TrainingDtypes

    class Failing(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 4)

        def training_step(self, batch, batch_idx):  # noqa: ANN001
            self.layer(batch)
            raise RuntimeError("boom in the first batch")

        def configure_optimizers(self):  # noqa: ANN201
            return torch.optim.SGD(self.parameters(), lr=0.1)

    before = dict(nn.modules.module._global_forward_hooks)
    observer = TrainingDtypes()
    trainer = pl.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[observer])
    with pytest.raises(RuntimeError, match="boom in the first batch"):
        trainer.fit(Failing(), train_dataloaders=DataLoader(torch.randn(4, 4), batch_size=2))
    assert dict(nn.modules.module._global_forward_hooks) == before and not observer._hooks
    assert not regional._held()
