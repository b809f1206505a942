"""One rank of the FSDP2 (torch ``fully_shard``, gloo, CPU) checks in tests/test_offload.py.

Run by the test as WORLD_SIZE processes with RANK, MASTER_ADDR and MASTER_PORT set; writes its
findings as JSON to ``argv[1]`` + ``.<rank>.json``. Two identical sharded models A and B see the
same batches; A runs its forward under ActivationOffloader and round-trips its AdamW state
(DTensor shards) through the host before its second step.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from lightning_mem.activation_offload import ActivationOffloader
from lightning_mem.offload import move_module, offload_optimizer_state, optimizer_state_location
from lightning_mem.optim import optimizer_state_bytes
from memtest_utils import lm_loss, tiny_llama, token_batches


def sharded_model(mesh):
    model = tiny_llama()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    a, b = sharded_model(mesh), sharded_model(mesh)
    opt_a = torch.optim.AdamW(a.parameters(), lr=1e-3)
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-3)
    batches = token_batches(2, seed=10 + rank)
    out: dict = {"rank": rank, "grads_equal": [], "stashed_bytes": []}

    for step, ids in enumerate(batches):
        offloader = ActivationOffloader(a, device="cpu", min_bytes=0)
        with offloader:
            loss_a = lm_loss(a, ids)
        loss_a.backward()
        lm_loss(b, ids).backward()
        out["stashed_bytes"].append(offloader.stats.stashed_bytes)
        out["grads_equal"].append(
            all(torch.equal(pa.grad.to_local(), pb.grad.to_local()) for pa, pb in zip(a.parameters(), b.parameters()))
        )
        if step == 1:
            out.update(round_trip(opt_a))
        opt_a.step()
        opt_b.step()
        opt_a.zero_grad()
        opt_b.zero_grad()

    out["params_equal"] = all(torch.equal(pa.to_local(), pb.to_local()) for pa, pb in zip(a.parameters(), b.parameters()))
    out["local_numel"] = sum(p.to_local().numel() for p in a.parameters())
    out["global_numel"] = sum(p.numel() for p in a.parameters())
    out["param_tensors"] = len(list(a.parameters()))
    out["state_bytes"] = optimizer_state_bytes(opt_a)
    try:
        move_module(a, "cpu")
        out["move_module_error"] = None
    except ValueError as err:
        out["move_module_error"] = str(err)
    with open(f"{sys.argv[1]}.{rank}.json", "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def round_trip(optimizer: torch.optim.Optimizer) -> dict:
    before = {
        (i, k): (v.to_local().clone(), v.to_local().data_ptr(), v.placements, v.device_mesh)
        for i, state in enumerate(optimizer.state.values())
        for k, v in state.items()
        if isinstance(v, DTensor)
    }
    with offload_optimizer_state(optimizer) as ledger:
        inside = {(i, k): v for i, state in enumerate(optimizer.state.values()) for k, v in state.items() if isinstance(v, DTensor)}
        moved_out = all(inside[key].to_local().data_ptr() != ptr for key, (_, ptr, _, _) in before.items())
        location_inside = optimizer_state_location(optimizer)
        ledger_bytes = ledger.bytes
        state_bytes_inside = optimizer_state_bytes(optimizer)
    after = {(i, k): v for i, state in enumerate(optimizer.state.values()) for k, v in state.items() if isinstance(v, DTensor)}
    exact = all(
        isinstance(after[key], DTensor)
        and after[key].placements == placements
        and after[key].device_mesh == mesh
        and torch.equal(after[key].to_local(), local)
        for key, (local, _, placements, mesh) in before.items()
    )
    return {
        "dtensor_state_tensors": len(before),
        "moved_out": moved_out,
        "location_inside": location_inside,
        "location_after": optimizer_state_location(optimizer),
        "ledger_bytes": ledger_bytes,
        "state_bytes_inside": state_bytes_inside,
        "round_trip_exact": exact,
    }


if __name__ == "__main__":
    main()
