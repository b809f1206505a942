"""Three clipped AdamW steps of a small model, under one precision and optimizer; run whole or FSDP2.

Shared by ``test_clipping.py`` (the one-device runs, in the pytest process) and, as a script, its
FSDP2 runs: ``python tests/clipping_worker.py SPEC.json`` with ``LOCAL_RANK``/``MASTER_PORT`` set per
rank by the test (as torchrun would), so one process runs every fit of the spec on one gloo group.
Every rank trains on the same batches, so data parallelism averages identical gradients: the weights
and gradient norms of a run must equal the one-device run's, whatever the world size -- which
holds for the clipped weights only if the norm clipped with is the global one, not a shard's.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader

from lightning_mem.clipping import ClipsGradients

#: Small enough that every step clips (the gradient norms are about 0.5-2).
CLIP = 0.01
STEPS = 3


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)) for _ in range(STEPS)]


class ClippedModule(ClipsGradients, pl.LightningModule):
    """Two linear layers (33 rows: FSDP2 shards them unevenly over 2 ranks), MSE loss."""

    def __init__(self, fused: bool, sharded: bool = False) -> None:
        super().__init__()
        self.fused = fused
        self.sharded = sharded
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 33), nn.Tanh(), nn.Linear(33, 16))
        self.norms: list[float] = []

    def configure_model(self) -> None:
        if not self.sharded:
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in (self.net[0], self.net[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        norm = self.trainer.callback_metrics.get("grad_norm")
        if norm is not None:
            self.norms.append(float(norm))

    def configure_optimizers(self):
        options = {"fused": True} if self.fused else {"foreach": True}
        # eps near the clipped gradients' size: Adam is then not blind to their scale, and a
        # clipped run ends far from an unclipped one (the tests check that it does).
        return torch.optim.AdamW(self.parameters(), lr=0.01, eps=1e-3, weight_decay=0.1, **options)


class LightningClipped(ClippedModule):
    """The same module with Lightning's own clipping (its precision plugin's), for reference."""

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        pl.LightningModule.configure_gradient_clipping(self, optimizer, gradient_clip_val, gradient_clip_algorithm)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        pass


def full_weights(module: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().clone()
            for name, p in module.named_parameters()}


def fit(module: ClippedModule, precision: str | None, algorithm: str = "norm", clip: float = CLIP, **trainer: object) -> dict:
    if precision is not None:
        trainer["precision"] = precision
    t = pl.Trainer(accelerator="cpu", max_steps=STEPS, gradient_clip_val=clip,
                   gradient_clip_algorithm=algorithm, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, **trainer)
    t.fit(module, DataLoader(batches(), batch_size=None))
    return {"weights": full_weights(module), "norms": module.norms}


def main(spec_path: str) -> None:
    from lightning.pytorch.strategies import ModelParallelStrategy

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    results = {}
    for precision in spec["precisions"]:
        for fused in (False, True):
            strategy = ModelParallelStrategy(data_parallel_size=spec["world"], tensor_parallel_size=1)
            run = fit(ClippedModule(fused, sharded=True), precision, devices=spec["world"], strategy=strategy,
                      use_distributed_sampler=False)
            results[f"{precision}/{'fused' if fused else 'foreach'}"] = run
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        torch.save(results, Path(spec["out"]))


if __name__ == "__main__":
    main(sys.argv[1])
