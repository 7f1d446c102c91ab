"""The numba CPU backend: graphs lowered to bound, compiled kernels over a planned arena."""

from .program import CpuProgram, lower

__all__ = ["lower", "CpuProgram"]
