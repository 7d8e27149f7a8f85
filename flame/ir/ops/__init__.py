"""Every op FLAME knows, declared once. Importing this package fills the registry."""

from flame.ir.ops import elementwise, joining, leaves, movement, reduce  # noqa: F401  (they register)
from flame.ir.ops.registry import HELPERS, OPS, OpDef, elementwise_ops, get_op

__all__ = ["HELPERS", "OPS", "OpDef", "elementwise_ops", "get_op"]
