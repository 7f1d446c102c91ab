"""The one op table, in three modules: core.py (the table and every primitive op), fused.py (ops
that passes produce) and collective.py (sums and gathers over ranks). Each op is one entry with its
arity, parameter schema, shape/dtype rule and numpy reference; importing this package registers
all of them. `from graphir.ops import OPS` is how everything else reads the table.
"""

from graphir.ops import collective, fused  # noqa: F401  (importing registers their ops)
from graphir.ops.core import (
    OPS,
    REQUIRED,
    SAMPLING_FIELDS,
    OpDef,
    Type,
    broadcastable,
    fail,
    need,
    need_float,
    need_i32,
    numel,
    op,
    sample_row,
)

__all__ = ["OPS", "REQUIRED", "SAMPLING_FIELDS", "OpDef", "Type", "broadcastable", "fail", "need", "need_float",
           "need_i32", "numel", "op", "sample_row"]
