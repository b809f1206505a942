"""Settings: typed constraints checked once for the parser and for Python, errors named relative to
what the library was given (no YAML path of ours), and named in full under a recipe's prefix."""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Literal

import pytest
import torch
from jsonargparse.typing import ClosedUnitInterval, NonNegativeFloat, OpenUnitInterval, PositiveFloat, PositiveInt

from lightning_mem.data import SFTDataModule
from lightning_mem.lora import LoraSettings
from lightning_mem.quantization import QuantizationSettings, check_placement
from lightning_mem.rl.config import GRPOConfig, KLConfig, PPOConfig
from lightning_mem.rl.engines import RolloutEngineConfig
from lightning_mem.rl.memory_plan import PhaseMemoryPlan, PhasePlacement
from lightning_mem.rl.rollout import GenerationConfig
from lightning_mem.settings import (
    AtLeastTwo,
    HalfOpenUnitInterval,
    SettingError,
    SettingPathError,
    check_fields,
    constraint_problem,
    settings_at,
)
from lightning_mem.strategies.zero_config import ZeroTier
from tests.helpers import ARITH, TINY_MODEL


@dataclass
class _Knobs:
    count: PositiveInt = 1
    share: OpenUnitInterval = 0.5
    dropout: HalfOpenUnitInterval = 0.0
    fraction: ClosedUnitInterval = 1.0
    weight: NonNegativeFloat = 0.0
    clip: PositiveFloat | None = None
    group: AtLeastTwo = 2
    mode: Literal["a", "b", "c"] = "a"
    flag: bool = True

    def __post_init__(self) -> None:
        check_fields(self)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"count": 0}, "`count` must be positive, got 0"),
        ({"count": 2.0}, "`count` must be an int, positive, got 2.0"),
        ({"count": True}, "`count` must be an int, positive, got True"),
        ({"share": 1.0}, "`share` must be in (0, 1), got 1.0"),
        ({"dropout": 1}, "`dropout` must be in [0, 1), got 1"),
        ({"fraction": -0.1}, "`fraction` must be in [0, 1], got -0.1"),
        ({"weight": -1}, "`weight` must be >= 0, got -1"),
        ({"clip": 0.0}, "`clip` must be positive or null, got 0.0"),
        ({"group": 1}, "`group` must be >= 2, got 1"),
        ({"mode": "d"}, "`mode` must be 'a', 'b' or 'c', got 'd'"),
        ({"flag": "yes"}, "`flag` must be true or false, got 'yes'"),
    ],
)
def test_a_dataclass_built_in_python_gets_the_parsers_rule_naming_the_field(kwargs, message):
    with pytest.raises(SettingError) as err:
        _Knobs(**kwargs)
    assert str(err.value) == message


def test_good_values_pass_and_parser_numbers_are_stored_as_builtins():
    knobs = _Knobs(count=PositiveInt(3), weight=NonNegativeFloat(0.5), clip=None, mode="b")
    # jsonargparse hands over its constraint classes (int/float subclasses): a checkpoint loaded
    # with weights_only=True refuses any class but the builtins.
    assert type(knobs.count) is int and type(knobs.weight) is float
    assert constraint_problem(int, "anything") is None  # unconstrained types are left to their users


def test_setting_error_is_named_from_a_prefix_with_its_siblings():
    err = SettingError("max_memory", " needs `device_map` (e.g. 'auto')", siblings=("device_map",))
    assert str(err) == "`max_memory` needs `device_map` (e.g. 'auto')"
    assert str(err.under("model")) == "`model.max_memory` needs `model.device_map` (e.g. 'auto')"
    assert str(err.under("model").under("outer")) == "`outer.model.max_memory` needs `outer.model.device_map` (e.g. 'auto')"
    leading = SettingError("name", "`name: vllm` needs vLLM")  # a message that names the key itself
    assert str(leading.under("engine")) == "`engine.name: vllm` needs vLLM"
    missing = SettingPathError("train_file", ": data file 'x' does not exist").under("data")
    assert isinstance(missing, FileNotFoundError) and str(missing) == "`data.train_file`: data file 'x' does not exist"
    again = pickle.loads(pickle.dumps(missing))
    assert type(again) is SettingPathError and str(again) == str(missing)


def test_settings_at_renames_setting_errors_only():
    with pytest.raises(SettingError, match=r"^`model.lora.r` must be positive, got 0$"), settings_at("model.lora"):
        LoraSettings(r=0)
    with pytest.raises(KeyError), settings_at("model"):
        raise KeyError("not a setting")
    with pytest.raises(SettingError, match=r"^`r` must be positive"), settings_at(""):
        LoraSettings(r=0)


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: LoraSettings(lora_dropout=1.0), "`lora_dropout` must be in [0, 1), got 1.0"),
        (lambda: LoraSettings(target_modules=[]), "`target_modules` is empty; use 'all-linear' or name some modules"),
        (lambda: QuantizationSettings(bits=3), "`bits` must be 4 or 8, got 3"),
        (lambda: QuantizationSettings(compute_dtype="float8"), "`compute_dtype`: unknown dtype 'float8'"),
        (lambda: check_placement(None, {0: "20GiB"}, None), "`max_memory` needs `device_map` (e.g. 'auto')"),
        (lambda: PPOConfig(clip_ratio=2.0), "`clip_ratio` must be in (0, 1), got 2.0"),
        (lambda: PPOConfig(max_tokens_per_microbatch=0), "`max_tokens_per_microbatch` must be positive or null, got 0"),
        (lambda: KLConfig(estimator="k4"), "`estimator` must be 'k1', 'k2', 'k3' or 'abs', got 'k4'"),
        (lambda: KLConfig(coef=0.0, target=1.0), "`target` (adaptive KL) needs an initial `coef` > 0"),
        (lambda: GRPOConfig(group_size=1), "`group_size` must be >= 2, got 1"),
        (lambda: GenerationConfig(temperature=0.0), "`temperature` must be positive, got 0.0"),
        (lambda: RolloutEngineConfig(max_model_len=1), "`max_model_len` must be >= 2 or null, got 1"),
        (lambda: PhasePlacement(critic="gpu"), "`critic` must be 'device' or 'host', got 'gpu'"),
        (lambda: PhaseMemoryPlan(score=PhasePlacement(critic="host")).validate(), "`score.critic` is 'host'"),
        (lambda: SFTDataModule(tokenizer=str(TINY_MODEL)), "set exactly one of `train_file`"),
        (lambda: SFTDataModule(str(ARITH / "val.jsonl"), tokenizer=str(TINY_MODEL), batch_size=0), "`batch_size` must be positive or null"),
    ],
)
def test_the_library_names_its_own_fields_never_a_recipes_yaml_path(build, message):
    # Someone importing lightning_mem into their own Lightning code, with their own config layout.
    with pytest.raises(ValueError) as err:
        build()
    assert str(err.value).startswith(message), str(err.value)
    assert "model." not in str(err.value) and "data." not in str(err.value)


def test_zero_tier_names_its_keyword_arguments():
    with pytest.raises(SettingError, match=r"^`reduce_bucket_size` must be positive, got 0$"):
        ZeroTier(reduce_bucket_size=0)
    with pytest.raises(SettingError, match=r"^`stage` must be 2 or 3, got 1$"):
        ZeroTier(stage=1)
    with pytest.raises(SettingError, match=r"^`sub_group_size` must be an int, positive, got 1000.0$"):
        ZeroTier(sub_group_size=1e3)


def test_a_checkpoint_of_settings_loads_with_weights_only(tmp_path):
    # The settings reach checkpoints as hyperparameters: builtins only, whatever built them.
    settings = LoraSettings(r=PositiveInt(8), lora_alpha=PositiveFloat(16))
    torch.save({"r": settings.r, "lora_alpha": settings.lora_alpha}, tmp_path / "c.pt")
    assert torch.load(tmp_path / "c.pt", weights_only=True) == {"r": 8, "lora_alpha": 16.0}
