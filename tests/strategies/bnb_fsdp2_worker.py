"""One rank of tests/strategies/test_bnb_fsdp2.py: bitsandbytes optimizers on FSDP2 shards.

Run as WORLD_SIZE (2) gloo processes with RANK, MASTER_ADDR and MASTER_PORT set; writes its
findings as JSON to ``argv[1]`` + ``.<rank>.json``. Per optimizer, on every rank:

* ``whole``: the model unsharded, the plain bitsandbytes optimizer (the reference);
* ``fsdp1``: FSDP2 over a 1-rank mesh (each rank its own), through ``step_local_shards``;
* ``fsdp2``: FSDP2 over both ranks.

All three see the same batches on every rank (so FSDP2's averaged gradient is that batch's) for 3
steps. Then the FSDP2 run's optimizer state is saved as a sharded checkpoint, loaded into a fresh
copy, and both take a 4th step. Last, LAMB8bit (``max_unorm``) on 2-rank shards is refused.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import bitsandbytes as bnb
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from lightning_mem.checkpointing import load_sharded_checkpoint
from lightning_mem.offload import local_tensor, offload_optimizer_state, optimizer_state_slots
from lightning_mem.optim import optimizer_state_bytes, step_local_shards

#: Shapes chosen against bitsandbytes' blocks of 256 values and its min_8bit_size of 4,096:
#: "aligned": 32 x 256, each of 2 shards is 16 whole blocks, the very blocks of the whole tensor;
#: "ragged": 33 x 128 = 4,224 values, shards of 17 and 16 rows (8.5 and 8 blocks) cut their blocks
#: elsewhere, and the whole tensor gets 8-bit state although each shard is under 4,096 values;
#: its checkpointed block scales pad rank 1's 8 to rank 0's 9. "small": 8 x 33, 32-bit state.
SHAPES = {"aligned": (32, 256), "ragged": (33, 128), "small": (8, 33)}
OPTIMIZERS = ("AdamW8bit", "PagedAdamW8bit", "PagedAdamW", "Adam8bit")
LR, STEPS = 1e-2, 3
MESHES: dict = {}


class Leaf(nn.Module):
    """One weight whose loss ``<w, g> + |w|^2 / 2`` has the gradient ``g + w``: each weight's
    trajectory depends on its own state only, so blocks that agree give equal weights."""

    def __init__(self, shape: tuple[int, int]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(shape) * 0.1)

    def forward(self, g: torch.Tensor) -> torch.Tensor:
        return (self.weight * g).sum() + 0.5 * self.weight.square().sum()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.leaves = nn.ModuleDict({name: Leaf(shape) for name, shape in SHAPES.items()})

    def forward(self, grads: dict[str, torch.Tensor]) -> torch.Tensor:
        return sum(leaf(grads[name]) for name, leaf in self.leaves.items())


def make_net() -> Net:
    torch.manual_seed(0)
    return Net()


def shard(model: Net, mesh) -> Net:  # noqa: ANN001
    for leaf in model.leaves.values():
        fully_shard(leaf, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [{name: torch.randn(shape, generator=g) for name, shape in SHAPES.items()} for _ in range(STEPS + 1)]


def train(model: nn.Module, optimizer: torch.optim.Optimizer, data: list) -> None:
    for x in data:
        model(x).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def full(param: torch.Tensor) -> torch.Tensor:
    return param.full_tensor() if hasattr(param, "full_tensor") else param.detach()


def expected_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """bitsandbytes' layout for this rank's shards, counted by hand: two moments per value, as
    uint8 codes plus one fp32 absmax per 256 values of the shard (8-bit, whole tensor >= 4,096
    values) or as fp32; the two 256-entry fp32 quantization maps once."""
    eight_bit = optimizer.args.optim_bits == 8
    total = 2 * 256 * 4 if eight_bit else 0
    for p in model.parameters():
        n = local_tensor(p).numel()
        if eight_bit and p.numel() >= 4096:
            total += 2 * n + 2 * 4 * math.ceil(n / 256)
        else:
            total += 2 * 4 * n
    return total


def state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [local_tensor(c[k]) for c, k, _, _ in optimizer_state_slots(optimizer)]


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out_path = Path(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    meshes = init_device_mesh("cpu", (world, 1), mesh_dim_names=("ranks", "alone"))
    meshes = {"fsdp1": meshes["alone"], "fsdp2": meshes["ranks"]}
    MESHES.update(meshes)
    data = batches()
    out: dict = {"rank": rank}
    for name in OPTIMIZERS:
        cls = getattr(bnb.optim, name)
        whole = make_net()
        start = {n: p.detach().clone() for n, p in whole.named_parameters()}
        train(whole, cls(whole.parameters(), lr=LR), data[:STEPS])
        res: dict = {}
        for run, mesh in meshes.items():
            model = shard(make_net(), mesh)
            optimizer = step_local_shards(cls(model.parameters(), lr=LR))
            train(model, optimizer, data[:STEPS])
            diff = {n: (full(p) - full(q)).abs().max().item() for (n, p), q in zip(model.named_parameters(), whole.parameters())}
            res[run] = {
                "max_diff": diff,
                "moved": {n: (full(p) - start[n]).abs().max().item() for n, p in model.named_parameters()},
                "state_bytes": optimizer_state_bytes(optimizer),
                "expected_state_bytes": expected_state_bytes(model, optimizer),
                "local_numel": sum(local_tensor(p).numel() for p in model.parameters()),
                "class_name": type(optimizer).__name__,
                "isinstance": isinstance(optimizer, cls),
            }
            if run == "fsdp2":
                res[run].update(offload_round_trip(optimizer))
                res[run].update(full_state_round_trip(model, optimizer, mesh, cls))
                res[run].update(checkpoint_round_trip(model, optimizer, mesh, cls, data[STEPS], out_path.parent / name))
        out[name] = res
    out["global_numel"] = sum(p.numel() for p in make_net().parameters())
    try:
        step_local_shards(bnb.optim.LAMB8bit(shard(make_net(), meshes["fsdp2"]).parameters()))
        out["lamb_error"] = None
    except ValueError as error:
        out["lamb_error"] = str(error)
    Path(f"{out_path}.{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def offload_round_trip(optimizer: torch.optim.Optimizer) -> dict:
    """lightning_mem.offload moves the local state (what optimizer_state_bytes counts) and back."""
    before = [t.clone() for t in state_tensors(optimizer)]
    with offload_optimizer_state(optimizer) as ledger:
        moved = ledger.bytes
    after = state_tensors(optimizer)
    return {"offloaded_bytes": moved,
            "offload_exact": len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))}


def full_state_round_trip(model, optimizer, mesh, cls) -> dict:  # noqa: ANN001
    """A full (gathered) optimizer state dict on rank 0, loaded back as Lightning loads a
    ``save_distributed_checkpoint: false`` file (broadcast from rank 0), gives every rank its state."""
    full_state = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    fresh = shard(make_net(), mesh)
    fresh_opt = step_local_shards(cls(fresh.parameters(), lr=LR))
    set_optimizer_state_dict(fresh, fresh_opt, optim_state_dict=full_state,
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    before, after = state_tensors(optimizer), state_tensors(fresh_opt)
    return {"full_state_equal": len(before) == len(after) and all(
        a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) for a, b in zip(before, after))}


def checkpoint_round_trip(model, optimizer, mesh, cls, x, folder: Path) -> dict:  # noqa: ANN001
    """Save model + optimizer as the FSDP2 strategy does (DCP), load into a fresh copy with
    lightning_mem.checkpointing.load_sharded_checkpoint, compare the state, step both once."""
    state = {"state_dict": get_model_state_dict(model), "optimizer_0": get_optimizer_state_dict(model, optimizer)}
    dcp.save(state, checkpoint_id=str(folder))
    fresh = shard(make_net(), mesh)
    fresh_opt = step_local_shards(cls(fresh.parameters(), lr=LR))
    load_sharded_checkpoint(fresh, [fresh_opt], folder, strict=True)
    before, after = state_tensors(optimizer), state_tensors(fresh_opt)
    state_equal = len(before) == len(after) and all(
        a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) for a, b in zip(before, after))
    steps_equal = all(optimizer.state[p]["step"] == fresh_opt.state[q]["step"]
                      for p, q in zip(model.parameters(), fresh.parameters()))
    # Another shard count (each rank alone): other blocks, refused with a message.
    alone = shard(make_net(), MESHES["fsdp1"])
    alone_opt = step_local_shards(cls(alone.parameters(), lr=LR))
    try:
        load_sharded_checkpoint(alone, [alone_opt], folder, strict=True)
        reshard_error = None
    except (Exception, CheckpointException) as error:  # noqa: BLE001 - the test reads which error it was
        reshard_error = f"{type(error).__name__}: {error}"
    train(model, optimizer, [x])
    train(fresh, fresh_opt, [x])
    return {
        "reshard_error": reshard_error,
        "loaded_state_equal": state_equal,
        "loaded_steps_equal": steps_equal,
        "loaded_state_bytes": optimizer_state_bytes(fresh_opt),
        "resumed_step_equal": all(torch.equal(local_tensor(p), local_tensor(q))
                                  for p, q in zip(model.parameters(), fresh.parameters())),
    }


if __name__ == "__main__":
    main()
