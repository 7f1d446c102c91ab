"""The CuPy GPU backend: graphs lowered to RawKernels (one source for CUDA and HIP) over a planned arena."""

from .device import available
from .program import GpuProgram, lower, new_state
from .step_queue import StepQueue

__all__ = ["lower", "GpuProgram", "new_state", "available", "StepQueue"]
