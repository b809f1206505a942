"""The DPO reference by memory plan (lightning_mem.preference_reference) and its log-prob cache
(lightning_mem.reference_cache): modes and their errors, the host-parked copy's placement, the
precompute pass's share and table, and a cache that is used only for the inputs it was made from."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from lightning_mem.offload import module_location
from lightning_mem.preference_reference import (
    HostParked,
    PolicyBase,
    ReferenceSettings,
    StartingPolicy,
    build_reference,
    check_table,
    looked_up,
    padded_share,
    reference_mode,
    reference_table,
)
from lightning_mem.reference_cache import ReferenceLogpCache, cache_key, code_version, weights_identity
from lightning_mem.settings import SettingError, settings_at


# -- modes ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("mode", "lora", "expected"), [
    ("auto", True, "adapters_off"), ("auto", False, "copy"), ("copy", True, "copy"), ("host", False, "host"),
    ("precompute", True, "precompute"), ("adapters_off", True, "adapters_off"),
])
def test_modes_resolve(mode, lora, expected):
    assert reference_mode(ReferenceSettings(mode=mode), needs_reference=True, lora=lora) == expected


def test_auto_with_other_weights_named_loads_a_copy_even_with_lora():
    settings = ReferenceSettings(mode="auto", name_or_path="some/model")
    assert reference_mode(settings, needs_reference=True, lora=True) == "copy"


@pytest.mark.parametrize("mode", ["auto", "copy", "host", "precompute", "none"])
def test_a_reference_free_objective_loads_none_whatever_the_mode(mode):
    assert reference_mode(ReferenceSettings(mode=mode), needs_reference=False, lora=False) is None


def test_none_under_an_objective_that_needs_a_reference_names_both_keys():
    with pytest.raises(SettingError, match=r"^`model.reference.mode` is 'none', but `model.dpo.loss_type: sigmoid`"
                                           r" compares the policy with a reference"):
        with settings_at("model.reference"):
            reference_mode(ReferenceSettings(mode="none"), needs_reference=True, lora=False,
                           loss="`model.dpo.loss_type: sigmoid`")


def test_adapters_off_needs_adapters_and_no_other_weights():
    with pytest.raises(SettingError, match=r"^`mode`: `adapters_off` switches off the policy's LoRA adapters, and this"
                                           r" policy has none"):
        reference_mode(ReferenceSettings(mode="adapters_off"), needs_reference=True, lora=False)
    with pytest.raises(SettingError, match=r"^`name_or_path` \('x/y'\) names other weights, but `mode: adapters_off`"):
        reference_mode(ReferenceSettings(mode="adapters_off", name_or_path="x/y"), needs_reference=True, lora=True)


def test_an_unknown_mode_is_refused_on_construction():
    with pytest.raises(SettingError, match=r"^`mode` must be 'auto', 'adapters_off', 'copy', 'host', 'precompute' or 'none'"):
        ReferenceSettings(mode="cpu")


# -- the reference objects --------------------------------------------------------------------------


class Doubler(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.tensor([2.0]))
        self.dropout = nn.Dropout(0.5)

    def forward(self, x):
        return self.dropout(x) * self.weight


def test_host_parked_copy_is_on_the_device_only_inside_its_forward():
    reference = build_reference("host")
    assert isinstance(reference, HostParked)
    module = reference.build(Doubler)
    assert not module.training and not module.weight.requires_grad and module.dropout.p == 0.0
    assert module_location(module) == "device"  # where the strategy put it
    reference.park()
    assert module_location(module) == "host"
    seen = []

    def score(model):
        seen.append(module_location(model))
        return model(torch.ones(3))

    out = reference.logprobs(None, score)
    assert seen == ["device"] and module_location(module) == "host"
    torch.testing.assert_close(out, torch.full((3,), 2.0))
    # The host copy is made once: a second forward parks the same host tensor again.
    parked = module.weight.data.data_ptr()
    reference.logprobs(None, score)
    assert module.weight.data.data_ptr() == parked and seen == ["device", "device"]


def test_host_parked_copy_goes_back_to_the_host_when_its_forward_fails():
    reference = build_reference("host")
    module = reference.build(Doubler)
    reference.park()

    def fail(model):
        raise RuntimeError("out of memory (simulated)")

    with pytest.raises(RuntimeError, match="simulated"):
        reference.logprobs(None, fail)
    assert module_location(module) == "host"


def test_the_starting_policy_scores_in_eval_mode_and_keeps_its_own_mode():
    policy = Doubler().train()
    reference = build_reference("starting_policy")
    assert isinstance(reference, StartingPolicy) and reference.build(Doubler) is None
    modes = []
    out = reference.logprobs(policy, lambda model: (modes.append(model.training), model(torch.ones(1000)))[1])
    assert modes == [False] and policy.training
    torch.testing.assert_close(out, torch.full((1000,), 2.0))  # no dropout mask


def test_adapters_off_scores_the_base_in_eval_mode():
    class Adapted(Doubler):
        def __init__(self):
            super().__init__()
            self.adapters = True

        def disable_adapter(self):
            import contextlib

            @contextlib.contextmanager
            def off():
                self.adapters = False
                yield
                self.adapters = True

            return off()

    policy = Adapted().train()
    seen = []
    build_reference("adapters_off").logprobs(policy, lambda model: seen.append((model.adapters, model.training)))
    assert isinstance(build_reference("adapters_off"), PolicyBase)
    assert seen == [(False, False)] and policy.adapters and policy.training


# -- the precompute pass -------------------------------------------------------------------------------


def test_padded_share_runs_as_many_forwards_as_the_longest_share_and_keeps_only_its_own():
    # 5 batches over 2 replicas: replica 0 has 3, replica 1 has 2 and repeats one, unkept.
    assert list(padded_share(["b1", "b3"], 3, lambda: "filler")) == [("b1", True), ("b3", True), ("b3", False)]
    # A replica with no batch at all borrows one (a tiny val set over many ranks).
    assert list(padded_share([], 2, lambda: "b0")) == [("b0", False), ("b0", False)]


def test_reference_table_places_each_pairs_sums_at_its_pair_index():
    batches = [({"pair_index": torch.tensor([3, 0])}, True), ({"pair_index": torch.tensor([1])}, True),
               ({"pair_index": torch.tensor([2])}, False)]  # another replica's: not kept
    sums = {3: (-1.0, -2.0), 0: (-3.0, -4.0), 1: (-5.0, -6.0), 2: (-7.0, -8.0)}

    def score(batch):  # [2B]: the chosen sides, then the rejected
        index = batch["pair_index"].tolist()
        return torch.tensor([sums[i][0] for i in index] + [sums[i][1] for i in index], dtype=torch.float64)

    table = reference_table(batches, score, 4, "cpu")
    assert table.dtype == torch.float32
    inf = float("-inf")
    torch.testing.assert_close(table, torch.tensor([[-3.0, -4.0], [-5.0, -6.0], [inf, inf], [-1.0, -2.0]]))
    with pytest.raises(ValueError, match=r"^x: 1 of 4 pairs were not scored \(pair 2 first\)"):
        check_table(table, 4, where="x")
    # Another replica scored pair 2 (and pair 1 too: a batch served twice): the max combines them.
    other = reference_table([({"pair_index": torch.tensor([2, 1])}, True)], score, 4, "cpu")
    table = torch.maximum(table, other)
    check_table(table, 4, where="x")
    torch.testing.assert_close(table[2], torch.tensor([-7.0, -8.0]))
    torch.testing.assert_close(table[1], torch.tensor([-5.0, -6.0]))
    chosen, rejected = looked_up(table, torch.tensor([1, 3]))
    torch.testing.assert_close(chosen, torch.tensor([-5.0, -1.0]))
    torch.testing.assert_close(rejected, torch.tensor([-6.0, -2.0]))
    with pytest.raises(ValueError, match=r"x: reference log-probs of shape \(4, 2\), expected \(5, 2\) for 5 pairs"):
        check_table(table, 5, where="x")


# -- the cache --------------------------------------------------------------------------------------


def _weights(folder, tensors):
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def test_weights_identity_tells_two_checkpoints_of_one_architecture_apart(tmp_path):
    # Same names, sizes and safetensors header: only the values differ, as before and after training.
    start = {"embed": torch.randn(1000, 64), "layers.0.w": torch.randn(64, 64), "norm": torch.ones(64)}
    a = _weights(tmp_path / "a", start)
    trained_norm = _weights(tmp_path / "b", {**start, "norm": start["norm"] + 1e-3 * torch.randn(64)})
    trained_embed = _weights(tmp_path / "c", {**start, "embed": start["embed"] + 1e-3 * torch.randn(1000, 64)})
    copy = _weights(tmp_path / "d", dict(start))
    assert len({(f / "model.safetensors").stat().st_size for f in (a, trained_norm, trained_embed)}) == 1
    assert weights_identity(str(a)) == weights_identity(str(copy))  # where the folder is does not matter
    assert weights_identity(str(a)) != weights_identity(str(trained_norm))  # one small tensor trained
    assert weights_identity(str(a)) != weights_identity(str(trained_embed))


def test_a_hub_id_not_on_disk_is_identified_by_its_id():
    assert weights_identity("nobody-here/no-such-model-xyz") == {"hub": "nobody-here/no-such-model-xyz"}


def test_code_version_follows_a_functions_source():
    def f():
        return 1

    def g():
        return 2

    assert code_version(f) == code_version(f) != code_version(g)
    assert code_version(torch.nn.functional) != code_version(f)


def _key(**changes):
    fields = dict(reference={"files": [["model.safetensors", 10, "ab"]]}, data="preference-train-1", precision="32-true",
                  dtype="float32", attention=None, code="c0")
    return cache_key(**{**fields, **changes})


def test_the_cache_gives_back_what_it_was_given_for_the_same_key(tmp_path):
    cache = ReferenceLogpCache(tmp_path / "logps")
    assert cache.lookup("train", _key()) is False  # missing
    table = torch.randn(7, 2)
    path = cache.save("train", _key(), table)
    assert path == tmp_path / "logps" / "train.safetensors" and not list(path.parent.glob("*.tmp-*"))
    assert cache.lookup("train", _key()) is True
    torch.testing.assert_close(cache.load("train", _key()), table, rtol=0, atol=0)
    assert cache.lookup("val", _key()) is False  # a file per split


@pytest.mark.parametrize(("change", "named"), [
    (dict(data="preference-train-2"), r"data \('preference-train-1' there, 'preference-train-2' here\)"),
    (dict(reference={"hub": "other/model"}), r"reference \('[0-9a-f]{12}' there, '\{\"hub\": \"other/model\"\}' here\)"),
    (dict(precision="bf16-mixed", dtype="bfloat16"), r"dtype \('float32' there, 'bfloat16' here\); precision"),
])
def test_a_cache_of_other_inputs_is_refused_in_one_line_naming_it_and_what_differs(tmp_path, change, named):
    cache = ReferenceLogpCache(tmp_path / "logps")
    cache.save("train", _key(), torch.zeros(3, 2))
    with pytest.raises(SettingError) as info:
        with settings_at("model.reference"):
            cache.lookup("train", _key(**change))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"`model.reference.cache_dir`: {tmp_path / 'logps' / 'train.safetensors'} holds reference"
                              " log-probs of other inputs (")
    assert message.endswith("delete it, or set `model.reference.cache_dir` to another folder")
    import re

    assert re.search(named, message), message


def test_a_file_that_is_no_cache_is_refused(tmp_path):
    cache = ReferenceLogpCache(tmp_path)
    cache.path("train").write_bytes(b"not safetensors")
    with pytest.raises(SettingError, match=r"^`cache_dir`: .*train.safetensors is not a reference log-prob file"):
        cache.lookup("train", _key())
