"""graphir: a small ggml-like tensor-graph IR for LLM inference, in pure Python.

Pipeline (data flows one way): models build Graphs -> passes rewrite them ->
a backend lowers them to a Program -> the runtime runs and replays it.
"""

from graphir import cpu_load  # noqa: F401  first: its load watch starts here (the cpu backend's auto threads)
from graphir.api import load
from graphir.builder import g
from graphir.errors import BackendError, GraphError, GraphirError, InputError, LoadError
from graphir.ir import Graph, Node
from graphir.jit import jit
from graphir.verify import verify

__version__ = "0.1.0"

__all__ = ["load", "g", "Graph", "Node", "jit", "verify", "GraphirError", "GraphError", "LoadError", "BackendError",
           "InputError"]
