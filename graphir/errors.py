"""The project's exception hierarchy.

Every message names the node, tensor or file involved and the rule that was broken,
so a user never has to read a numpy traceback to learn what went wrong.
"""


class GraphirError(Exception):
    """Base class for every error graphir raises on purpose."""


class GraphError(GraphirError):
    """A graph is malformed: bad shape, dtype, params, cycle, or an illegal write."""


class LoadError(GraphirError):
    """A weight or tokenizer file is missing, truncated, corrupt or unsupported."""


class BackendError(GraphirError):
    """A backend cannot lower or run a graph (unsupported op or dtype, bad input)."""


class InputError(GraphirError):
    """A runtime input is wrong: token id out of range, prompt longer than the context."""
