"""Every op FLAME knows, declared once. Importing this package fills the registry."""

from flame.ir.ops import (  # noqa: F401  (declarations register themselves)
    attention,
    collective,
    conv,
    elementwise,
    indexing,
    joining,
    leaves,
    linalg,
    movement,
    random,
    reduce,
)
from flame.ir.ops.registry import HELPERS, OPS, OpDef, elementwise_ops, get_op

__all__ = ["HELPERS", "OPS", "OpDef", "elementwise_ops", "get_op"]
