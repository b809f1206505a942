import pytest
import torch

from lightning_mem.models import check_model_source, count_parameters, has_weights, load_causal_lm, load_tokenizer
from tests.helpers import TINY_MODEL


def test_tiny_model_initialises_from_config_only():
    assert not has_weights(TINY_MODEL)
    model = load_causal_lm(str(TINY_MODEL))
    assert 1_000_000 < count_parameters(model) < 10_000_000
    assert type(model).__name__ == "LlamaForCausalLM"


def test_weights_round_trip_through_from_pretrained(tmp_path):
    torch.manual_seed(0)
    model = load_causal_lm(str(TINY_MODEL))
    model.save_pretrained(tmp_path)
    load_tokenizer(str(TINY_MODEL)).save_pretrained(tmp_path)
    assert has_weights(tmp_path)
    again = load_causal_lm(str(tmp_path))
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name


def test_dtype_from_string():
    assert next(load_causal_lm(str(TINY_MODEL), dtype="bfloat16").parameters()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        load_causal_lm(str(TINY_MODEL), dtype="float8")


@pytest.mark.parametrize("path", ["./missing-model", "/nowhere/model", "a/b/c"])
def test_missing_model_path_is_named(path):
    with pytest.raises(FileNotFoundError, match="model.name_or_path.*does not exist"):
        check_model_source(path, key="model.name_or_path")  # the key the recipes pass


def test_hub_id_is_accepted_without_touching_the_network():
    assert check_model_source("Qwen/Qwen2.5-0.5B") == "hub"


def test_folder_without_config_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        check_model_source(str(tmp_path))
