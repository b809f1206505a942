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
