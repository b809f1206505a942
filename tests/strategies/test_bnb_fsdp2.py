"""bitsandbytes optimizers under FSDP2: each rank steps its local shard (lightning_mem.optim.LocalShardStep).

One spawn of 2 gloo ranks (``bnb_fsdp2_worker.py``) trains three weights for 3 steps with
AdamW8bit, PagedAdamW8bit (pages nothing on CPU, still steps), PagedAdamW (32-bit) and Adam8bit:
unsharded (the reference), FSDP2 on a 1-rank mesh, FSDP2 on both ranks. It also saves and
reloads the 2-rank state as a sharded checkpoint. A CLI run is the issue's repro: the SFT recipe
on ``configs/sft/tiny_cpu.yaml`` with FSDP2Strategy and AdamW8bit, gradient clipping on.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import HANG_GUARD_S, read_metric, run_recipe, short_fit_args

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))

from bnb_fsdp2_worker import LR, OPTIMIZERS, STEPS  # noqa: E402

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("bnb_fsdp2") / "res"
    env = dict(os.environ, WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests"), str(HERE)]), OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen([sys.executable, str(HERE / "bnb_fsdp2_worker.py"), str(out)], env=dict(env, RANK=str(r)),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(WORLD)
    ]
    try:
        logs = [p.communicate(timeout=HANG_GUARD_S)[0] for p in procs]
    finally:
        for p in procs:  # a hung rank must not outlive the test
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-4000:]
    return [json.loads(Path(f"{out}.{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_weights_after_3_steps_equal_the_unsharded_optimizer_to_blockwise_rounding(ranks, name):
    eight_bit = "8bit" in name
    for res in ranks:
        one, two = res[name]["fsdp1"], res[name]["fsdp2"]
        assert one["class_name"] == name and one["isinstance"]
        # One rank: the local shard is the whole tensor, so blocks and steps are the unsharded ones.
        assert all(d == 0.0 for d in one["max_diff"].values()), one["max_diff"]
        # Two ranks: 32-bit state is element-wise (exact); so is 8-bit state where every shard is
        # whole blocks of 256 ("aligned": 16 x 256 rows per rank) or the state is 32-bit ("small").
        diff = two["max_diff"]
        assert diff["leaves.aligned.weight"] == 0.0 and diff["leaves.small.weight"] == 0.0, diff
        # "ragged" (17 and 16 rows of 128) cuts blocks elsewhere: each moment is quantized against
        # another block's absmax, i.e. rounded to a neighbouring 8-bit code. Adam's update
        # m/sqrt(v) moves by a small fraction of lr through that; a tenth of lr per step bounds it
        # with room (measured 1.3e-3 after 3 steps of lr 1e-2, i.e. 4 % of lr per step), while
        # every weight moved by about lr per step, 30 times the bound, so a wrong state would show.
        bound = 0.1 * LR * STEPS
        if eight_bit:
            assert 0.0 < diff["leaves.ragged.weight"] <= bound, diff
        else:
            assert diff["leaves.ragged.weight"] == 0.0, diff
        assert all(moved >= 0.9 * LR * STEPS for moved in two["moved"].values()), two["moved"]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_each_rank_holds_exactly_its_shards_state(ranks, name):
    # uint8 codes + one fp32 absmax per 256 values *of the local shard* for tensors of >= 4,096
    # values (decided by the whole tensor: "ragged"'s shards are under 4,096), fp32 otherwise;
    # the two 256-entry quantization maps once per rank (worker.expected_state_bytes).
    for res in ranks:
        for run in ("fsdp1", "fsdp2"):
            assert res[name][run]["state_bytes"] == res[name][run]["expected_state_bytes"]
    one = ranks[0][name]["fsdp1"]["state_bytes"]
    two = [res[name]["fsdp2"]["state_bytes"] for res in ranks]
    maps = 2 * 256 * 4 if "8bit" in name else 0
    # About half each: the sharded parts add up to the whole, but for blocks cut by the shards.
    assert sum(two) - 2 * maps == pytest.approx(one - maps, rel=0.01)
    assert sum(r[name]["fsdp2"]["local_numel"] for r in ranks) == ranks[0]["global_numel"]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_sharded_checkpoint_round_trips_the_local_state_and_the_next_step(ranks, name):
    for res in ranks:
        two = res[name]["fsdp2"]
        assert two["loaded_state_equal"] and two["loaded_steps_equal"]
        assert two["loaded_state_bytes"] == two["state_bytes"]  # quantization maps shared again
        assert two["resumed_step_equal"]
        assert two["full_state_equal"]  # a gathered (save_distributed_checkpoint: false) state, loaded back
        if "8bit" in name:
            # Loading it where each rank holds the whole tensor would pair codes with other
            # blocks' scales: the block scales' shape (one row per shard) makes DCP refuse it.
            assert "Size mismatch" in two["reshard_error"] and "absmax1" in two["reshard_error"]
        else:
            assert two["reshard_error"] is None  # 32-bit state is element-wise: it reshards


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_optimizer_state_offload_moves_the_local_state_bit_exactly(ranks, name):
    for res in ranks:
        two = res[name]["fsdp2"]
        assert two["offloaded_bytes"] == two["state_bytes"] and two["offload_exact"]


def test_norm_scaled_updates_on_shards_are_refused_naming_the_optimizer(ranks):
    for res in ranks:
        assert "LAMB8bit" in res["lamb_error"] and "max_unorm" in res["lamb_error"]
        assert "model.optimizer" in res["lamb_error"]


def test_sft_recipe_with_fsdp2_and_adamw8bit_trains_checkpoints_and_resumes(tmp_path):
    """The issue's CPU repro: tiny_cpu.yaml (gradient clipping 1.0) with FSDP2Strategy and
    AdamW8bit, 2 steps with a sharded checkpoint each, then a resume for a 3rd step."""
    args = short_fit_args(
        "configs/sft/tiny_cpu.yaml", tmp_path, 2,
        '--trainer.strategy={"class_path": "lightning_mem.strategies.FSDP2Strategy"}',
        "--model.optimizer=bitsandbytes.optim.AdamW8bit",
    )
    first = run_recipe("sft", *args)
    assert first.returncode == 0, first.stderr[-4000:]
    assert "optimizer state uint8" in first.stderr + first.stdout
    losses = read_metric(tmp_path, "train_loss")
    assert len(losses) == 2 and all(v == v for v in losses.values())
    resumed = run_recipe("sft", *[a.replace("max_steps=2", "max_steps=3") for a in args], "--ckpt_path=last")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert sorted(read_metric(tmp_path, "train_loss")) == [0, 1, 2]
