"""The random stream an RL step samples from, kept apart from the process's global one.

A PPO step draws random numbers when it samples responses (``generate``) and when it shuffles
mini-batches (``randperm``). For a resumed run to repeat the uninterrupted one exactly, that
stream's state must go into the checkpoint and come back. Saving the *global* state is not
enough: between two steps, code outside the step draws from it too, and draws differently in a
resumed run (a new DataLoader iterator takes a seed from the global generator, at every epoch
start and again when a run resumes mid-epoch). So the step runs on its own stream: swapped in
when a step starts, swapped out when it ends, saved with the checkpoint.

Covers the CPU generator and, when CUDA is initialised, the current CUDA device's generator
(the ones ``torch.multinomial``/``randperm`` use on each device).
"""

from __future__ import annotations

from typing import Any

import torch


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


class SamplingRNG:
    """A private torch random stream, entered and left around each RL step.

    ``SamplingRNG()`` starts from the global state at that moment (so ``seed_everything`` fixes it);
    :meth:`enter` makes it the global state and keeps the outside one aside; :meth:`exit` stores
    the advanced stream and puts the outside state back. ``state_dict``/``load_state_dict`` carry it
    in a checkpoint.
    """

    def __init__(self) -> None:
        self.cpu: torch.Tensor = torch.get_rng_state()
        self.cuda: torch.Tensor | None = torch.cuda.get_rng_state() if _cuda_in_use() else None
        self._outside: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def enter(self) -> None:
        if self._outside is not None:
            return  # already inside (a step that raised never left)
        cuda = _cuda_in_use()
        self._outside = (torch.get_rng_state(), torch.cuda.get_rng_state() if cuda else None)
        torch.set_rng_state(self.cpu)
        if cuda:
            if self.cuda is None:  # CUDA came up after the stream was made: start its CUDA part here
                self.cuda = torch.cuda.get_rng_state()
            torch.cuda.set_rng_state(self.cuda)

    def exit(self) -> None:
        if self._outside is None:
            return
        self.cpu = torch.get_rng_state()
        if _cuda_in_use():
            self.cuda = torch.cuda.get_rng_state()
        outside_cpu, outside_cuda = self._outside
        torch.set_rng_state(outside_cpu)
        if outside_cuda is not None:
            torch.cuda.set_rng_state(outside_cuda)
        self._outside = None

    def state_dict(self) -> dict[str, Any]:
        # Between steps the stream is out; inside one (a checkpoint written mid-step) it is live.
        live = self._outside is not None
        cpu = torch.get_rng_state() if live else self.cpu
        cuda = torch.cuda.get_rng_state() if live and _cuda_in_use() else self.cuda
        return {"cpu": cpu.clone(), "cuda": None if cuda is None else cuda.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cpu = state["cpu"].clone().cpu()
        self.cuda = None if state.get("cuda") is None else state["cuda"].clone().cpu()
