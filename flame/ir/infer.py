"""Type inference: the result dtype and shape of a node, from its op's declaration.

The tensor layer calls ``infer`` when it builds a node (so bad input fails at the user's
line); the verifier calls it again after every pass.
"""

from __future__ import annotations

from flame.ir import dtypes
from flame.ir.ops import get_op
from flame.ir.shapes import ShapeError


def _describe(inputs) -> str:
    return ", ".join(f"{node.dtype.name}{list(node.shape)}" for node in inputs)


def infer(op_name: str, inputs, attrs: dict) -> tuple[dtypes.DType, tuple[int, ...]]:
    op = get_op(op_name)
    if op.arity >= 0 and len(inputs) != op.arity:  # -1: any number (cat)
        raise TypeError(f"{op_name}: takes {op.arity} inputs, got {len(inputs)}")
    if op.kind == "elementwise":
        return _infer_elementwise(op, inputs, attrs)
    if op.shape_rule is not None:
        return op.shape_rule(inputs, attrs)
    raise TypeError(f"{op_name}: a leaf is built directly, not inferred")


def is_scalar_const(node) -> bool:
    """Scalar constants are the one implicit broadcast in the IR: ``mul(%x, 1.5)``."""
    return node.op == "const" and node.shape == ()


def _infer_elementwise(op, inputs, attrs):
    shapes = {node.shape for node in inputs if not is_scalar_const(node)}
    if len(shapes) > 1:
        raise ShapeError(f"{op.name}: inputs must share one shape, got {_describe(inputs)}")
    shape = shapes.pop() if shapes else ()
    if op.name == "cast":
        return dtypes.dtype(attrs["dtype"]), shape
    operands = inputs[1:] if op.name == "where" else inputs
    if op.name == "where" and not inputs[0].dtype.is_bool:
        raise TypeError(f"where: the condition must be bool, got {inputs[0].dtype.name}")
    first = operands[0].dtype
    for node in operands[1:]:
        if node.dtype is not first:
            raise TypeError(f"{op.name}: operands must share one dtype, got {_describe(inputs)}")
    if not op.accepts(first.category):
        raise TypeError(f"{op.name}: not defined for {first.name} (inputs {_describe(inputs)})")
    return (dtypes.bool_ if op.out_bool else first), shape


def make_node(op_name: str, inputs: tuple, attrs: dict | None = None, site=None):
    """Build a checked node: attrs sorted by name so equal nodes hash equally."""
    from flame.ir.node import Node

    attrs = attrs or {}
    dtype, shape = infer(op_name, inputs, attrs)
    return Node(op_name, tuple(inputs), tuple(sorted(attrs.items())), dtype, shape, site)


NAN = float("nan")


def canonical_float(value: float) -> float:
    """``value``, with every NaN the same object: attributes compare and hash by value, and
    NaN is unequal to itself (its hash is its identity), so a constant NaN made anew in each
    step of a loop would make each step's graph a new plan."""
    return NAN if value != value else value


class SizeValue(float):
    """A float computed from sizes (``1/N`` of a mean, ``1/(N-1)`` of a variance): used as
    an operand, it becomes a constant the kernels take as an argument, so a new size runs the
    same code (issue 21). Arithmetic on it gives plain floats: wrap the final value.

    ``role`` names what it is (``"1/n[2, 3]"``): two constants of different roles stay two
    kernel arguments when their values happen to be equal (a square image's 1/H and 1/W),
    so the code never depends on whether sizes coincide."""

    __slots__ = ("role",)

    def __new__(cls, value, role: str = "size"):
        made = float.__new__(cls, value)
        made.role = role
        return made


def make_const(value, dtype: dtypes.DType, site=None, round_to_dtype: bool = False):
    """A scalar constant. A Python number used as an operand keeps its value and is used in
    compute precision (float32 for float16/bfloat16 ops, as PyTorch does); a tensor filled
    with a value (``full``) holds the value rounded to its dtype: ``round_to_dtype``.
    Integers must fit the dtype."""
    from flame.ir.node import Node

    sized = value.role if isinstance(value, SizeValue) and dtype.is_float else None
    if dtype.is_float:
        if round_to_dtype and not (type(value) is int and -256 <= value <= 256):
            value = float(dtype.numpy.type(value))  # small ints are exact in every float type
        value = canonical_float(float(value))
    elif dtype.is_bool:
        value = bool(value)
    else:
        value = int(value)
        bits = 8 * dtype.itemsize
        if bits < 32:  # as PyTorch: a scalar wraps into an 8- or 16-bit type
            value &= (1 << bits) - 1
            if dtype.name != "uint8" and value >= 1 << (bits - 1):
                value -= 1 << bits
        elif not -(2 ** (bits - 1)) <= value < 2 ** (bits - 1):
            raise ValueError(f"the scalar {value} does not fit {dtype.name}")
    attrs = (("value", value), ("sized", sized)) if sized else (("value", value),)
    return Node("const", (), attrs, dtype, (), site)
