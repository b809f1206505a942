"""Train a model that ``from_pretrained(device_map=...)`` spread over devices, CPU and disk.

Lightning's single-device strategy moves the whole LightningModule to its root device before
training. A Hugging Face model loaded with a ``device_map`` is already where it should be: some
layers on each GPU, some in host memory or on disk behind accelerate's hooks (their parameters
sit on the meta device between forwards). Moving it would pile every layer onto one device, or
fail outright on the meta tensors. :class:`DeviceMapStrategy` moves everything else and leaves a
placed model where ``from_pretrained`` put it.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch import nn
from typing_extensions import override


def is_placed(module: nn.Module) -> bool:
    """True for a model whose layers were dispatched by ``from_pretrained(device_map=...)``.

    transformers records the placement as ``hf_device_map``; a peft wrapper forwards the attribute.
    """
    return bool(getattr(module, "hf_device_map", None))


class DeviceMapStrategy(SingleDeviceStrategy):
    """A single-process strategy that keeps a ``device_map``-placed model in place.

    Batches still go to ``device`` (the root device: put the embeddings there, as ``device_map``
    "auto" does with the first layers). Everything in the LightningModule that is not a placed
    model is moved to ``device`` as usual.

    Example (YAML)::

        trainer:
          strategy:
            class_path: lightning_mem.strategies.DeviceMapStrategy
            init_args: {device: cuda:0}
    """

    strategy_name = "device_map"

    def __init__(self, device: Any = "cpu", **kwargs: Any) -> None:
        super().__init__(device=device, **kwargs)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None, "self.model must be set before model_to_device()"
        self._move_unplaced(self.model, self.root_device)

    @override
    def teardown(self) -> None:
        # Strategy.teardown moves the whole module (and its optimizer state) to CPU to free the
        # device. The placed model cannot move (its disk layers are meta tensors) and keeps its
        # optimizer state beside its adapters; the rest goes to CPU as usual.
        if self.lightning_module is not None:
            self._move_unplaced(self.lightning_module, torch.device("cpu"))
        self.precision_plugin.teardown()
        assert self.accelerator is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    def _move_unplaced(self, module: nn.Module, device: torch.device) -> None:
        # Walk down to the placed models and move everything around them: a module's own
        # parameters and buffers here, its children by recursion (a placed child is left alone).
        # The LightningModule's `device` already reads the root device (Lightning sets it before
        # `setup`), so nothing else needs updating.
        if is_placed(module):
            return
        for param in module.parameters(recurse=False):
            param.data = param.data.to(device)
        for name, buffer in module.named_buffers(recurse=False):
            setattr(module, name, buffer.to(device))
        for child in module.children():
            self._move_unplaced(child, device)
