"""ZeRO tiers -> DeepSpeed config dicts, exactly. Pure functions: no DeepSpeed needed."""

from __future__ import annotations

import json

import pytest

from lightning_mem.settings import SettingError
from lightning_mem.strategies.zero_config import (
    ZERO_PRESETS,
    ZeroTier,
    deepspeed_config,
    precision_config,
    zero_tier,
)

STAGE2_ZERO = {
    "stage": 2,
    "overlap_comm": True,
    "contiguous_gradients": True,
    "reduce_bucket_size": 500_000_000,
    "reduce_scatter": True,
    "allgather_partitions": True,
    "allgather_bucket_size": 500_000_000,
}
STAGE3_ZERO = {
    "stage": 3,
    "overlap_comm": True,
    "contiguous_gradients": True,
    "reduce_bucket_size": 500_000_000,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_param_persistence_threshold": 100_000,
    "stage3_max_live_parameters": 1_000_000_000,
    "sub_group_size": 1_000_000_000,
}
CPU_OFFLOAD = {"device": "cpu", "pin_memory": True}
BF16 = {"bf16": {"enabled": True}}

EXPECTED_BF16 = {
    "zero2": {"zero_allow_untested_optimizer": True, "zero_optimization": STAGE2_ZERO, **BF16},
    "zero2_offload": {
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {**STAGE2_ZERO, "offload_optimizer": CPU_OFFLOAD},
        **BF16,
    },
    "zero3": {"zero_allow_untested_optimizer": True, "zero_optimization": STAGE3_ZERO, **BF16},
    "zero3_offload_optimizer": {
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {**STAGE3_ZERO, "offload_optimizer": CPU_OFFLOAD},
        **BF16,
    },
    "zero3_offload": {
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {**STAGE3_ZERO, "offload_optimizer": CPU_OFFLOAD, "offload_param": CPU_OFFLOAD},
        **BF16,
    },
    "zero3_offload_nvme": {
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {
            **STAGE3_ZERO,
            "offload_optimizer": {"device": "nvme", "pin_memory": True, "nvme_path": "/nvme", "buffer_count": 4},
            "offload_param": {
                "device": "nvme",
                "pin_memory": True,
                "nvme_path": "/nvme",
                "buffer_count": 5,
                "buffer_size": 100_000_000,
                "max_in_cpu": 1_000_000_000,
            },
        },
        **BF16,
    },
}


def test_every_preset_has_an_expected_config() -> None:
    assert set(EXPECTED_BF16) == set(ZERO_PRESETS)


@pytest.mark.parametrize("preset", sorted(EXPECTED_BF16))
def test_preset_config_is_exact(preset: str) -> None:
    nvme = {"nvme_path": "/nvme"} if "nvme" in preset else {}
    config = deepspeed_config(zero_tier(preset, **nvme), "bf16-true")
    assert config == EXPECTED_BF16[preset]
    # DeepSpeed reads its config as JSON: nothing in it may be a Python-only type.
    assert json.loads(json.dumps(config)) == config


@pytest.mark.parametrize(
    ("precision", "section"),
    [
        ("bf16-true", {"bf16": {"enabled": True}}),
        ("bf16-mixed", {"bf16": {"enabled": True}}),
        (
            "16-mixed",
            {
                "fp16": {
                    "enabled": True,
                    "loss_scale": 0,
                    "initial_scale_power": 16,
                    "loss_scale_window": 1000,
                    "hysteresis": 2,
                    "min_loss_scale": 1,
                }
            },
        ),
        ("32-true", {}),
    ],
)
def test_precision_section_follows_the_trainer_precision(precision: str, section: dict) -> None:
    assert precision_config(precision) == section
    config = deepspeed_config(zero_tier("zero2"), precision)
    assert {k: v for k, v in config.items() if k in ("bf16", "fp16")} == section


def test_no_precision_leaves_the_section_to_the_strategy() -> None:
    assert set(deepspeed_config(zero_tier("zero2"))) == {"zero_allow_untested_optimizer", "zero_optimization"}


def test_unsupported_precision_names_the_argument() -> None:
    with pytest.raises(SettingError, match=r"^`precision` 'transformer-engine' is not supported with DeepSpeed"):
        deepspeed_config(zero_tier("zero2"), "transformer-engine")


def test_overrides_apply_on_top_of_the_preset() -> None:
    tier = zero_tier(
        "zero3_offload",
        offload_params=False,
        pin_memory=False,
        reduce_bucket_size=1_000,
        prefetch_bucket_size=2_000,
        param_persistence_threshold=0,
        max_live_parameters=3_000,
        sub_group_size=4_000,
        overlap_comm=False,
    )
    assert tier.stage == 3 and tier.offload_params == "none" and tier.offload_optimizer == "cpu"
    assert deepspeed_config(tier)["zero_optimization"] == {
        "stage": 3,
        "overlap_comm": False,
        "contiguous_gradients": True,
        "reduce_bucket_size": 1_000,
        "stage3_prefetch_bucket_size": 2_000,
        "stage3_param_persistence_threshold": 0,
        "stage3_max_live_parameters": 3_000,
        "sub_group_size": 4_000,
        "offload_optimizer": {"device": "cpu", "pin_memory": False},
    }


def test_none_overrides_keep_the_preset() -> None:
    assert zero_tier("zero3_offload", stage=None, offload_params=None) == zero_tier("zero3_offload")


def test_no_preset_is_plain_zero2() -> None:
    assert zero_tier() == ZeroTier() == zero_tier("zero2")
    assert zero_tier(stage=3, offload_optimizer=True).offload_optimizer == "cpu"
    assert zero_tier("zero2_offload", offload_optimizer=False).offloads_optimizer is False


def test_stage2_allgather_bucket_override() -> None:
    zero = deepspeed_config(zero_tier("zero2", allgather_bucket_size=7, reduce_bucket_size=9))["zero_optimization"]
    assert (zero["allgather_bucket_size"], zero["reduce_bucket_size"]) == (7, 9)


def test_cpu_adam_off_lets_deepspeed_step_the_client_optimizer_on_the_host() -> None:
    assert deepspeed_config(zero_tier("zero2_offload"), cpu_adam=False)["zero_force_ds_cpu_optimizer"] is False
    assert "zero_force_ds_cpu_optimizer" not in deepspeed_config(zero_tier("zero2_offload"))
    # Without an offloaded optimizer the flag means nothing and is left out.
    assert "zero_force_ds_cpu_optimizer" not in deepspeed_config(zero_tier("zero2"), cpu_adam=False)


def test_extra_config_merges_key_by_key_and_is_not_aliased() -> None:
    extra = {"zero_optimization": {"stage3_max_reuse_distance": 0}, "wall_clock_breakdown": True}
    config = deepspeed_config(zero_tier("zero3"), "bf16-true", extra_config=extra)
    assert config["zero_optimization"] == {**STAGE3_ZERO, "stage3_max_reuse_distance": 0}
    assert config["wall_clock_breakdown"] is True
    config["zero_optimization"]["stage3_max_reuse_distance"] = 5
    assert extra == {"zero_optimization": {"stage3_max_reuse_distance": 0}, "wall_clock_breakdown": True}
    # Each call builds a new dict: a strategy filling batch keys cannot leak into the next one.
    first = deepspeed_config(zero_tier("zero2"))
    first["zero_optimization"]["stage"] = 99
    assert deepspeed_config(zero_tier("zero2"))["zero_optimization"]["stage"] == 2


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"stage": 1}, SettingError, r"^`stage` must be 2 or 3, got 1$"),
        ({"stage": 2, "offload_params": "cpu"}, SettingError, r"^`offload_params: cpu` needs `stage: 3`"),
        ({"preset": "zero2", "offload_params": True}, SettingError, r"^`offload_params: cpu` needs `stage: 3`"),
        ({"stage": 3, "offload_params": "nvme"}, SettingError, r"^`nvme_path` is required"),
        ({"preset": "zero3_offload_nvme"}, SettingError, r"^`nvme_path` is required"),
        ({"preset": "zero3_offload", "nvme_path": "/nvme"}, SettingError, r"^`nvme_path` '/nvme' is set but nothing"),
        ({"preset": "zero4"}, SettingError, r"^`preset` 'zero4' is not a ZeRO preset"),
        ({"offload_optimizer": "gpu"}, SettingError, r"^`offload_optimizer` 'gpu' is not an offload device"),
        ({"offload_params": "disk", "stage": 3}, SettingError, r"^`offload_params` 'disk' is not an offload device"),
        ({"reduce_bucket_size": 0}, SettingError, r"^`reduce_bucket_size` must be positive, got 0$"),
        ({"allgather_bucket_size": 5e8}, SettingError, r"^`allgather_bucket_size` must be an int, positive, got 500000000.0$"),
        ({"prefetch_bucket_size": True}, SettingError, r"^`prefetch_bucket_size` must be an int, positive, got True$"),
        ({"param_persistence_threshold": -1}, SettingError, r"^`param_persistence_threshold` must be >= 0, got -1$"),
        ({"pin_memory": "yes"}, SettingError, r"^`pin_memory` must be true or false, got 'yes'$"),
        ({"bucket_size": 10}, TypeError, r"unknown ZeRO tier argument\(s\) \['bucket_size'\]"),
    ],
)
def test_impossible_tiers_fail_naming_the_argument(kwargs: dict, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        zero_tier(**kwargs)


def test_tier_validates_when_built_directly() -> None:
    with pytest.raises(SettingError, match=r"^`offload_params: cpu` needs `stage: 3`"):
        ZeroTier(stage=2, offload_params="cpu")
