"""Lightning callbacks that apply the memory techniques of :mod:`lightning_mem`."""

from lightning_mem.callbacks.activation_offload import ActivationOffload, ActivationOffloader, ActivationOffloadStats

__all__ = ["ActivationOffload", "ActivationOffloadStats", "ActivationOffloader"]
