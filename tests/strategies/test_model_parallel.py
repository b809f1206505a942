"""Tensor, sequence and context parallelism under FSDP2Strategy: the recipes' own steps, split and whole.

Two spawns of real gloo ranks (``model_parallel_worker.py``) run the SFT and PPO recipes' modules
on the tiny Llama:

* 2 ranks: tensor parallelism with sequence parallelism (TP2), and context parallelism (CP2), each
  against a one-process run in this process: SFT steps (full and LoRA), a PPO iteration (critic,
  reference, 2 mini-batches) and a GRPO iteration; parameter bytes per rank; bytes saved for
  backward on a 2,048-token sequence. Also a plain data-parallel run (DP2) of PPO and GRPO, the
  reference for the 4-rank runs.
* 4 ranks: TP2 x DP2 and CP2 x DP2: SFT against a one-process run accumulating the two replicas'
  batches; PPO and GRPO against the DP2 runs (a PPO rollout is sampled per replica, from the same
  seeded stream, which one process sampling all prompts at once does not reproduce).

"Equal" is to 1e-5 (fp32) for losses and for every gradient at the first optimizer step: Adam's
first update is the gradient's sign, so equal losses after a step would not show a gradient
that is off by a factor.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))

import model_parallel_scenarios as sc  # noqa: E402

from tests.helpers import HANG_GUARD_S  # noqa: E402

TP2 = {"tensor_parallel_size": 2, "sequence_parallel": True}
CP2 = {"context_parallel_size": 2}

SPLIT2 = [
    {"name": "sft_tp2", "kind": "sft", "strategy": TP2},
    {"name": "sft_cp2", "kind": "sft", "strategy": CP2},
    {"name": "lora_tp2", "kind": "sft", "lora": True, "strategy": TP2},
    {"name": "ppo_tp2", "kind": "ppo", "strategy": TP2},
    {"name": "ppo_cp2", "kind": "ppo", "strategy": CP2},
    {"name": "grpo_tp2", "kind": "grpo", "batch_size": 2, "strategy": TP2},
    {"name": "grpo_cp2", "kind": "grpo", "batch_size": 2, "strategy": CP2},
    {"name": "act_cp2", "kind": "activations", "strategy": CP2},
    {"name": "act_tp2", "kind": "activations", "strategy": TP2},
    {"name": "ppo_dp2", "kind": "ppo", "strategy": {}},
    {"name": "grpo_dp2", "kind": "grpo", "batch_size": 2, "strategy": {}},
]
SPLIT4 = [
    {"name": "sft_tp2_dp2", "kind": "sft", "strategy": TP2},
    {"name": "sft_cp2_dp2", "kind": "sft", "strategy": CP2},
    {"name": "ppo_tp2_dp2", "kind": "ppo", "strategy": TP2},
    {"name": "grpo_cp2_dp2", "kind": "grpo", "batch_size": 2, "strategy": CP2},
]


def run_worker(out: Path, runs: list[dict], devices: int) -> dict:
    out.mkdir(parents=True)
    spec_path = out / "spec.json"
    spec_path.write_text(json.dumps({"out": str(out), "devices": devices, "runs": runs}))
    inherited = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "PL_GLOBAL_SEED")}
    env = {**inherited, "PYTHONPATH": os.pathsep.join([str(REPO), str(HERE), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(HERE / "model_parallel_worker.py"), str(spec_path)], env=env,
                          capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, f"worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(devices)]
    return {run["name"]: [rank[run["name"]] for rank in ranks] for run in runs}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("model_parallel")


@pytest.fixture(scope="module")
def split2(workdir) -> dict:
    return run_worker(workdir / "split2", SPLIT2, devices=2)


@pytest.fixture(scope="module")
def split4(workdir) -> dict:
    return run_worker(workdir / "split4", SPLIT4, devices=4)


@pytest.fixture(scope="module")
def whole(workdir) -> dict:
    """One-process runs of the same steps."""
    out = workdir / "whole"
    out.mkdir()
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runs = [
            {"name": "sft", "kind": "sft"},
            {"name": "sft_acc2", "kind": "sft", "accumulate": 2},
            {"name": "lora", "kind": "sft", "lora": True},
            {"name": "ppo", "kind": "ppo"},
            {"name": "grpo", "kind": "grpo", "batch_size": 2},
            {"name": "act", "kind": "activations"},
        ]
        return {run["name"]: sc.fit(run, out) for run in runs} | {"dir": out}
    finally:
        torch.set_num_threads(previous)


def gradients(workdir: Path, spawn: str, name: str) -> dict[str, torch.Tensor]:
    folder = workdir / spawn if spawn != "whole" else workdir / "whole"
    return torch.load(folder / f"{name}.gradients.pt")


def assert_same_gradients(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


def assert_same_metrics(got: list[dict], want: list[dict], keys: tuple[str, ...]) -> None:
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want)):
        for key in keys:
            assert g[key] == pytest.approx(w[key], rel=1e-5, abs=1e-6), (step, key, g[key], w[key])


PPO_KEYS = ("policy_loss", "value_loss", "kl", "approx_kl", "entropy", "reward_mean", "response_length")
GRPO_KEYS = ("policy_loss", "kl", "approx_kl", "entropy", "reward_mean", "response_length")


# ---------------------------------------------------------------- 2 ranks: TP2 and CP2 vs one process


@pytest.mark.parametrize("name", ["sft_tp2", "sft_cp2"])
def test_sft_steps_equal_one_process(split2, whole, workdir, name):
    for rank in split2[name]:  # every rank of the group logs the whole batch's loss
        assert_same_metrics(rank["metrics"], whole["sft"]["metrics"], ("train_loss",))
    assert_same_gradients(gradients(workdir, "split2", name), gradients(workdir, "whole", "sft"))


def test_lora_sft_under_tensor_parallelism_equals_one_process(split2, whole, workdir):
    assert_same_metrics(split2["lora_tp2"][0]["metrics"], whole["lora"]["metrics"], ("train_loss",))
    got, want = gradients(workdir, "split2", "lora_tp2"), gradients(workdir, "whole", "lora")
    assert all("lora_" in name for name in want)  # the frozen base (norms included) gets no gradient
    assert_same_gradients(got, want)


@pytest.mark.parametrize("name", ["ppo_tp2", "ppo_cp2"])
def test_ppo_iteration_equals_one_process(split2, whole, workdir, name):
    assert_same_metrics(split2[name][0]["metrics"], whole["ppo"]["metrics"], PPO_KEYS)
    assert whole["ppo"]["metrics"][0]["policy_loss"] != 0.0  # the rewards differ, so the update is real
    assert_same_gradients(gradients(workdir, "split2", name), gradients(workdir, "whole", "ppo"))


@pytest.mark.parametrize("name", ["grpo_tp2", "grpo_cp2"])
def test_grpo_iteration_equals_one_process(split2, whole, workdir, name):
    assert_same_metrics(split2[name][0]["metrics"], whole["grpo"]["metrics"], GRPO_KEYS)
    assert_same_gradients(gradients(workdir, "split2", name), gradients(workdir, "whole", "grpo"))


def test_each_tensor_parallel_rank_holds_half_of_the_split_weights(split2):
    for rank in split2["sft_tp2"]:
        model = rank["models"]["model"]
        # FSDP over one data-parallel rank shards nothing more: a rank's part of a split weight is half
        # (the 307-row vocabulary splits 154 + 153, so allow one row of the embedding and output layer).
        assert abs(2 * model["split_local_x_fsdp"] - model["split_whole"]) <= 2 * 256 * 4
        replicated = model["whole"] - model["split_whole"]  # the norms: 9 x 256 floats
        assert replicated == 9 * 256 * 4
        assert model["local"] == model["split_local_x_fsdp"] + replicated
        assert model["local"] / model["whole"] == pytest.approx(0.5, abs=0.01)


def test_context_parallelism_halves_the_bytes_saved_for_backward(split2, whole):
    one = whole["act"]["saved_bytes"][0]
    layers, local_tokens, hidden = 4, sc.LONG_SEQUENCE // 2, 256
    # Every activation covers this rank's 1,024 of the 2,048 tokens. Ulysses adds one per layer: the
    # attention output comes back from the all-to-all in a buffer of its own, which the output
    # projection keeps, beside the kernel's own output (in one process they share storage). Left:
    # a few KB of positions and gathered log-probabilities.
    expected = one / 2 + layers * local_tokens * hidden * 4
    for rank in split2["act_cp2"]:
        assert abs(rank["saved_bytes"][0] - expected) < 64 * 1024, (rank["saved_bytes"][0], expected, one)


def test_sequence_parallelism_splits_what_tensor_parallelism_leaves_whole(split2, whole):
    one = whole["act"]["saved_bytes"][0]
    for rank in split2["act_tp2"]:
        ratio = rank["saved_bytes"][0] / one
        # Each attention and MLP region keeps its gathered whole-sequence input for the weight
        # gradient; everything else is split by heads, columns or sequence.
        assert ratio < 0.7, ratio


# ---------------------------------------------------------------- 4 ranks: TP2 x DP2 and CP2 x DP2


@pytest.mark.parametrize("name", ["sft_tp2_dp2", "sft_cp2_dp2"])
def test_sft_with_two_replicas_equals_one_process_accumulating_their_batches(split4, whole, workdir, name):
    reference = whole["sft_acc2"]["metrics"]  # micro-batches of both replicas, in replica order
    for rank in split4[name]:
        replica = rank["rank"] // 2
        assert_same_metrics(rank["metrics"], reference[replica::2], ("train_loss",))
    assert_same_gradients(gradients(workdir, "split4", name), gradients(workdir, "whole", "sft_acc2"))


@pytest.mark.parametrize(("name", "reference", "keys"), [
    ("ppo_tp2_dp2", "ppo_dp2", PPO_KEYS), ("grpo_cp2_dp2", "grpo_dp2", GRPO_KEYS),
])
def test_rl_iteration_with_two_replicas_equals_plain_data_parallel(split2, split4, workdir, name, reference, keys):
    assert_same_metrics(split4[name][0]["metrics"], split2[reference][0]["metrics"], keys)
    assert_same_gradients(gradients(workdir, "split4", name), gradients(workdir, "split2", reference))
