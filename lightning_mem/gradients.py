"""Gradients live from backward to the optimizer step, and not a moment longer.

Lightning's automatic optimization zeroes gradients inside the *next* step's closure, after that
step's ``training_step`` (forward -> zero_grad -> backward -> step): the previous step's gradients,
a full copy of the trainable parameters' bytes, are alive through every forward, on top of its
activations. A plain PyTorch loop, HF Trainer and torchtune free them right after the step;
:class:`FreesGradientsAfterStep` makes a LightningModule do the same. With gradient accumulation
Lightning calls ``optimizer_step`` only at the step boundary, so accumulated gradients are kept
until then; clipping runs inside the step, before it.
"""

from __future__ import annotations

from typing import Any

from typing_extensions import override


class FreesGradientsAfterStep:
    """LightningModule mixin: every optimizer step sets the gradients it consumed to None at once.

    Put it before ``LightningModule`` in the bases (``class MyModule(FreesGradientsAfterStep,
    LightningModule)``). Manual optimization does the same by calling
    ``optimizer.zero_grad(set_to_none=True)`` right after ``optimizer.step()``.
    """

    @override
    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)  # type: ignore[misc]
        optimizer.zero_grad(set_to_none=True)
