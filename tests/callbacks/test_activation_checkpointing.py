import pytest
import torch
from memtest_utils import TinyLM, fit, lm_loss, saved_activation_bytes, token_batches

from lightning_mem.callbacks import ActivationCheckpointing
from lightning_mem.settings import SettingError

#: Where the callback's arguments are named (a regex).
ARGS = r"trainer\.callbacks\[ActivationCheckpointing\]\.init_args"


def _grads_after_fit(tmp_path, callbacks):
    torch.manual_seed(0)
    module = TinyLM()
    fit(module, tmp_path, steps=2, callbacks=callbacks)
    ids = token_batches(1)[0]
    module.model.zero_grad()
    saved = saved_activation_bytes(module.model, lambda: lm_loss(module.model, ids).backward())[0]
    grads = {n: p.grad.clone() for n, p in module.model.named_parameters()}
    return module, saved, grads


def test_same_gradients_and_at_least_3x_fewer_saved_bytes(tmp_path):
    _, plain_saved, plain_grads = _grads_after_fit(tmp_path / "plain", [])
    callback = ActivationCheckpointing()
    _, ckpt_saved, ckpt_grads = _grads_after_fit(tmp_path / "ckpt", [callback])
    assert callback.checkpointed == {"model": 4}
    assert plain_grads.keys() == ckpt_grads.keys()
    for name in plain_grads:
        assert torch.equal(plain_grads[name], ckpt_grads[name]), name
    assert plain_saved >= 3 * ckpt_saved, (plain_saved, ckpt_saved)


def test_every_second_block(tmp_path):
    callback = ActivationCheckpointing(every=2)
    fit(TinyLM(), tmp_path, steps=1, callbacks=[callback])
    assert callback.checkpointed == {"model": 2}


def test_unknown_block_class_is_named(tmp_path):
    with pytest.raises(SettingError, match=rf"^`{ARGS}.block_classes`: `model`: `LlamaForCausalLM` has no module of class \['NoSuchBlock'\]"):
        fit(TinyLM(), tmp_path, steps=1, callbacks=[ActivationCheckpointing(block_classes=["NoSuchBlock"])])


def test_every_must_be_positive():
    with pytest.raises(SettingError, match=rf"^`{ARGS}.every` must be >= 1, got 0$"):
        ActivationCheckpointing(every=0)


def test_policy_blocks_and_input_offload_from_the_callback(tmp_path):
    from lightning_mem.activation_checkpointing import is_checkpointed

    callback = ActivationCheckpointing(policy="selective", blocks=3, offload_inputs=True)
    module = TinyLM()
    fit(module, tmp_path, steps=1, callbacks=[callback])
    assert callback.checkpointed == {"model": 3}
    assert [is_checkpointed(b) for b in module.model.model.layers] == [True, True, True, False]
    assert module.model._lightning_mem_input_offloader.stats.stashed_tensors > 0


@pytest.mark.parametrize("kwargs, match", [(dict(policy="most"), "policy` must be one of"),
                                           (dict(blocks=-1), "blocks` must be >= 0")])
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(SettingError, match=rf"^`{ARGS}." + match):
        ActivationCheckpointing(**kwargs)


def test_a_budget_without_the_cli_is_refused_at_fit_start(tmp_path):
    with pytest.raises(SettingError, match=rf"^`{ARGS}.budget` is turned into `{ARGS}.blocks` by the recipe command line"):
        fit(TinyLM(), tmp_path, steps=1, callbacks=[ActivationCheckpointing(budget="1GiB")])


def test_fewest_blocks_within_a_budget_asks_few_estimates():
    from lightning_mem.activation_checkpointing import fewest_blocks_within

    asked = []

    def peak_of(n):  # 1000 bytes of weights, 100 per unchecked block, 10 per checkpointed one
        asked.append(n)
        return 1000 + 100 * (24 - n) + 10 * n

    assert fewest_blocks_within(5000, peak_of, 24) == (0, {0: 3400})
    asked.clear()
    n, peaks = fewest_blocks_within(3000, peak_of, 24)
    assert n == 5 and peak_of(5) <= 3000 < peak_of(4)
    assert len(set(asked)) <= 4
    with pytest.raises(ValueError, match="checkpointing alone cannot fit it"):
        fewest_blocks_within(1100, peak_of, 24)


def test_the_estimator_models_each_checkpointing_mode(tmp_path):
    """The estimate runs the recipe's callbacks: each mode changes it, in the order of what each
    mode keeps, and it matches the real fit's measured peak."""
    import json

    from lightning_mem.estimate import estimate, measure_fit
    from lightning_mem.estimate.measure import filling_rows

    rows = filling_rows(tmp_path)["sft"]

    def overrides(**init_args):
        callbacks = [{"class_path": "lightning_mem.callbacks.ActivationCheckpointing", "init_args": init_args}]
        return [*rows, f"--trainer.callbacks={json.dumps(callbacks if init_args else [])}"]

    peak = {name: estimate("configs/sft/tiny_cpu.yaml", overrides(**args)).device_peak_bytes
            for name, args in dict(none={}, selective=dict(policy="selective"), full=dict(every=1)).items()}
    assert peak["full"] < peak["selective"] < peak["none"], peak
    measured = max(p.device_peak_bytes for p in measure_fit("configs/sft/tiny_cpu.yaml", overrides(policy="selective"), steps=2)[0])
    assert measured == pytest.approx(peak["selective"], rel=0.05)


def test_a_callback_that_has_nothing_to_work_on_names_itself():
    import types

    from torch import nn

    from lightning_mem.callbacks import CompileBlocks, LigerKernels
    from lightning_mem.strategies import FSDP2Strategy

    plain = types.SimpleNamespace(strategy=object())  # a trainer whose strategy is not FSDP2
    for callback in (ActivationCheckpointing(), CompileBlocks(), LigerKernels()):
        name = type(callback).__name__
        with pytest.raises(SettingError, match=rf"^`trainer.callbacks\[{name}\]`: the LightningModule holds no Hugging"
                                               r" Face model"):
            callback.on_fit_start(plain, nn.Linear(2, 2))
    fsdp2 = types.SimpleNamespace(strategy=FSDP2Strategy())
    with pytest.raises(SettingError, match=r"^`trainer.callbacks\[ActivationCheckpointing\]` under FSDP2Strategy: set"
                                           r" `trainer.strategy.init_args.activation_checkpointing` instead"):
        ActivationCheckpointing().on_fit_start(fsdp2, nn.Linear(2, 2))
