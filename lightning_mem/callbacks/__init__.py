"""Lightning callbacks that apply the memory techniques of :mod:`lightning_mem`.

Each is a thin wrapper over a primitive a recipe can also call directly:
``ActivationOffload`` over ``ActivationOffloader``, ``OptimizerStateOffload`` over
``lightning_mem.offload.optimizer_state_to_host``/``_to_device``, ``OptimizerInBackward`` over
``lightning_mem.optim.StepInBackward``.
"""

from lightning_mem.callbacks.activation_checkpointing import ActivationCheckpointing
from lightning_mem.activation_offload import ActivationOffloader, ActivationOffloadStats
from lightning_mem.callbacks.activation_offload import ActivationOffload
from lightning_mem.callbacks.compile_blocks import CompileBlocks
from lightning_mem.callbacks.fit_check import FitCheck
from lightning_mem.callbacks.liger_kernels import LigerKernels
from lightning_mem.callbacks.memory_monitor import MemoryMonitor, PhaseObserver, memory_phase
from lightning_mem.callbacks.optimizer_in_backward import OptimizerInBackward
from lightning_mem.callbacks.optimizer_state_offload import OptimizerStateOffload
from lightning_mem.callbacks.progress import StepProgressBar, StepRichProgressBar
from lightning_mem.callbacks.shared_casts import SharedCasts
from lightning_mem.callbacks.training_dtypes import DtypeReport, TrainingDtypes

__all__ = [
    "ActivationCheckpointing",
    "ActivationOffload",
    "ActivationOffloadStats",
    "ActivationOffloader",
    "CompileBlocks",
    "DtypeReport",
    "FitCheck",
    "LigerKernels",
    "MemoryMonitor",
    "OptimizerInBackward",
    "OptimizerStateOffload",
    "SharedCasts",
    "StepProgressBar",
    "StepRichProgressBar",
    "TrainingDtypes",
    "memory_phase",
    "PhaseObserver",
]
