"""The gradient norm over a 2 x 2 mesh (data parallel x tensor parallel): one rank of four gloo ranks.

``python tests/clipping_mesh_worker.py OUT.pt`` with ``RANK``/``WORLD_SIZE``/``MASTER_PORT`` set by
``test_clipping.py``. A two-layer MLP is split as the recipes split a Llama block: the first layer
column-wise, the second row-wise over the tensor-parallel dimension, then ``fully_shard`` over the
data-parallel one; a layer norm's weight stays replicated over TP. FSDP2 gives the column-wise
weight ``(_StridedShard(0), Shard(0))`` -- dimension 0 split by both -- whose ``is_shard()`` is False
in torch 2.13. Rank 0 saves :func:`gradient_norm` of the DTensor gradients and the norm of their
full tensors, for p = 1, 2 and inf; every rank checks it holds the same norm as the others.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn


def main(out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from lightning_mem.clipping import gradient_norm

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 12), nn.Tanh(), nn.Linear(12, 8))
    parallelize_module(model, mesh["tensor_parallel"], {"1": ColwiseParallel(), "3": RowwiseParallel()})
    fully_shard(model, mesh=mesh["data_parallel"])
    torch.manual_seed(1 + mesh.get_local_rank("data_parallel"))  # replicas see their own batch
    model(torch.randn(5, 8)).pow(2).sum().backward()
    grads = [p.grad for p in model.parameters()]
    placements = sorted({str(tuple(g.placements)) for g in grads})
    result = {"placements": placements}
    for p in (1.0, 2.0, float("inf")):
        got = gradient_norm(grads, p)
        mine = got.clone()
        dist.all_reduce(got, op=dist.ReduceOp.MAX)
        assert torch.equal(got, mine), f"rank {dist.get_rank()}: norm {mine} differs from another rank's {got}"
        full = torch.cat([g.full_tensor().flatten() for g in grads])
        result[str(p)] = (mine, torch.linalg.vector_norm(full, p))
    if dist.get_rank() == 0:
        torch.save(result, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
