"""The lazy ``Tensor``: it holds one IR node; operators build nodes; nothing runs until a
value is asked for (``.numpy()``, ``.item()``, ``.realize()``, DLPack, ...).

Every op is built through ``apply``, which applies the op's declared promotion, broadcasts,
checks, and records the user's line, so bad input fails here, when the op is built. The
common elementwise cases (``x + y``, ``-x``, ``flame.exp(x)``) take the fast paths of
flame/fast_paths.py, which build the same nodes and fall back to ``apply``.
"""

from __future__ import annotations

import contextvars

import numpy as np

from flame.backend import get_backend, realize_nodes
from flame.ir import dtypes
from flame.ir.infer import make_const
from flame.ir.node import Node, builder_site, format_site
from flame.ir.ops import OPS, get_op
from flame.ir.shapes import ShapeError, broadcast_shapes

_NUMBER_TYPES = (bool, int, float, np.bool_, np.integer, np.floating)


# False inside flame.no_grad(): results are detached (autograd does not look through them)
grad_enabled: contextvars.ContextVar[bool] = contextvars.ContextVar("flame_grad", default=True)


def result(node: Node, backend: str) -> Tensor:
    """The tensor an op returns: detached when built under ``no_grad``."""
    if not grad_enabled.get():
        node = Node("detach", (node,), (), node.dtype, node.shape, node.site)
    return Tensor(node, backend)


class Tensor:
    __slots__ = ("node", "backend", "grad", "__weakref__")
    __array_priority__ = 1000  # NumPy defers to our reflected operators
    __array_ufunc__ = None

    def __init__(self, node: Node, backend: str):
        self.node = node
        self.backend = backend
        self.grad = None  # accumulated by backward() (flame/autograd.py)

    # --- metadata (never runs anything) -------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return self.node.shape

    @property
    def dtype(self) -> dtypes.DType:
        return self.node.dtype

    @property
    def ndim(self) -> int:
        return len(self.node.shape)

    def numel(self) -> int:
        return self.node.numel

    def size(self, dim: int | None = None):
        if dim is None:
            return self.shape
        if not -self.ndim <= dim < self.ndim:
            raise IndexError(f"size: dim {dim} out of range for {self.ndim}-d tensor")
        return self.shape[dim]

    @property
    def is_realized(self) -> bool:
        return self.node.buffer is not None or self.node.op == "buffer"

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    def __repr__(self) -> str:
        state = "realized" if self.is_realized else f"lazy: {self.node.op}"
        return (
            f"tensor(shape={list(self.shape)}, dtype={self.dtype.name}, {state}, "
            f"backend={self.backend})"
        )

    __str__ = __repr__

    def ir(self) -> str:
        """The IR text of the graph behind this tensor."""
        from flame.ir.graph import Graph

        return str(Graph((self.node,)))

    # --- realization ----------------------------------------------------------------------
    def realize(self) -> Tensor:
        node = self.node
        if node.buffer is None and node.op != "buffer":  # ``realize(self)``, kept short
            realize_nodes(self.backend, [node])
        return self

    def _storage(self):
        from flame.compile import check_not_tracing

        check_not_tracing("reading the value")
        self.realize()
        return self.node.buffer if self.node.buffer is not None else self.node.attr("storage")

    def numpy(self) -> np.ndarray:
        return np.asarray(self._storage().numpy()).reshape(self.shape)

    def tolist(self):
        return self.numpy().tolist()

    def item(self):
        if self.numel() != 1:
            raise ValueError(f"item: tensor has {self.numel()} elements, shape {list(self.shape)}")
        return self.numpy().reshape(()).item()

    def __array__(self, dtype=None, copy=None):
        array = self.numpy()
        return array if dtype is None else array.astype(dtype)

    def __bool__(self) -> bool:
        return bool(self.item())

    def __float__(self) -> float:
        return float(self.item())

    def __int__(self) -> int:
        return int(self.item())

    def __index__(self) -> int:
        if not self.dtype.is_int:
            raise TypeError(f"only integer tensors can be used as an index, not {self.dtype.name}")
        return int(self.item())

    # --- casts ------------------------------------------------------------------------------
    def to(self, dtype) -> Tensor:
        target = dtypes.dtype(dtype)
        if target is self.dtype:
            return self
        return _cast(self, target)

    def float(self):
        return self.to(dtypes.float32)

    def half(self):
        return self.to(dtypes.float16)

    def bfloat16(self):
        return self.to(dtypes.bfloat16)

    def int(self):
        return self.to(dtypes.int32)

    def long(self):
        return self.to(dtypes.int64)

    def bool(self):
        return self.to(dtypes.bool_)

    def clamp(self, min=None, max=None) -> Tensor:  # noqa: A002 (PyTorch's names)
        return clamp(self, min, max)

    clip = clamp

    def where(self, condition, other) -> Tensor:
        return apply("where", condition, self, other)

    # --- operators ---------------------------------------------------------------------------
    def __pos__(self):
        return self

    def __abs__(self):
        return apply("abs", self)

    def __invert__(self):
        return apply("bitwise_not", self)


# --- building ops ---------------------------------------------------------------------------


def _operand_error(op_name: str, value) -> TypeError:
    return TypeError(
        f"{op_name}: expected a flame.Tensor or a Python number, got {type(value).__name__}"
    )


def _result_dtype(op, tensors, scalars, op_name) -> dtypes.DType:
    if len(tensors) == 1 and not scalars:
        result = tensors[0].dtype
    else:  # PyTorch's tiers: tensors with dimensions, then 0-d tensors, then Python numbers
        dimensioned = [tensor.dtype for tensor in tensors if tensor.node.shape]
        zero_dim = [tensor.dtype for tensor in tensors if not tensor.node.shape]
        result = dtypes.result_type(dimensioned, zero_dim, scalars)
    if op.promotion == "int_to_float" and not result.is_float:
        result = dtypes.DEFAULT_FLOAT
    if not op.accepts(result.category):
        shown = ", ".join(_describe(value) for value in (*tensors, *scalars))
        raise TypeError(f"{op_name}: not defined for {result.name} (inputs: {shown})")
    return result


def _describe(value) -> str:
    if isinstance(value, Tensor):
        return f"{value.dtype.name}{list(value.shape)}"
    return repr(value)


def _common_backend(op_name, tensors) -> str:
    if not tensors:
        return get_backend()
    first = tensors[0].backend
    for tensor in tensors[1:]:
        if tensor.backend != first:
            raise ValueError(
                f"{op_name}: tensors on different backends ({first} and {tensor.backend}); "
                "create them under the same flame.backend(...)"
            )
    return first


def _lift(value, dtype, shape, site) -> Node:
    """An operand as a node of ``dtype`` and ``shape``: cast and broadcast where needed."""
    if isinstance(value, Tensor):
        node = value.node
        if node.dtype is not dtype:
            node = Node("cast", (node,), (("dtype", dtype),), dtype, node.shape, site)
    else:
        return make_const(value, dtype, site)  # scalars broadcast implicitly
    if node.shape != shape:
        node = Node("expand", (node,), (("shape", shape),), dtype, shape, site)
    return node


def apply(op_name: str, *operands, **attrs) -> Tensor:
    """Build ``op_name`` over tensors and Python numbers, with promotion and broadcasting.

    The result type comes from the op's declared promotion; operands are cast and broadcast
    by explicit ``cast``/``expand`` nodes, so every op node sees inputs of one shape. Errors
    name the op, the operands and the user's line.
    """
    op = OPS.get(op_name) or get_op(op_name)
    site = builder_site()
    tensors = []
    scalars = []
    for value in operands:
        if type(value) is Tensor:
            tensors.append(value)
        elif isinstance(value, _NUMBER_TYPES):
            scalars.append(value)
        elif isinstance(value, Tensor):
            tensors.append(value)
        else:
            raise _with_site(_operand_error(op_name, value), site)
    try:
        backend_name = _common_backend(op_name, tensors)
        if len(tensors) == 1:
            shape = tensors[0].node.shape
        else:
            shape = broadcast_shapes(op_name, *(t.node.shape for t in tensors)) if tensors else ()
        if op.promotion == "where":
            inputs, dtype = _where_inputs(op, operands, shape, site)
        elif op.promotion == "none":
            inputs = (tensors[0].node,)
            dtype = dtypes.dtype(attrs["dtype"])
        else:
            dtype = _result_dtype(op, tensors, scalars, op_name)
            inputs = tuple(_lift(value, dtype, shape, site) for value in operands)
        if op.out_bool:
            dtype = dtypes.bool_
        if attrs:
            _check_attrs(op, attrs)
            attrs = tuple(sorted(attrs.items()))
        else:
            attrs = ()
    except (ShapeError, TypeError, ValueError) as error:
        raise _with_site(error, site) from None
    return result(Node(op_name, inputs, attrs, dtype, shape, site), backend_name)


def _cast(x: Tensor, target: dtypes.DType) -> Tensor:
    """``apply("cast", x, dtype=target)`` for a known dtype: the node ``apply`` builds,
    without its operand and attribute checks (a step casts every parameter under autocast
    and in the optimizer's float32 arithmetic)."""
    node = x.node
    made = Node("cast", (node,), (("dtype", target),), target, node.shape, builder_site())
    return result(made, x.backend)


def _with_site(error: Exception, site) -> Exception:
    if site is None or "[at " in str(error):
        return error
    return type(error)(f"{error} [at {format_site(site)}]")


def _check_attrs(op, attrs) -> None:
    unknown = set(attrs) - set(op.attrs)
    if unknown:
        raise TypeError(f"{op.name}: unexpected argument(s) {', '.join(sorted(unknown))}")


def _where_inputs(op, operands, shape, site):
    condition, *values = operands
    if isinstance(condition, Tensor) and not condition.dtype.is_bool:
        raise TypeError(f"where: the condition must be bool, got {condition.dtype.name}")
    dtype = _where_dtype(op, values, "where")
    inputs = [_lift(condition, dtypes.bool_, shape, site)]
    inputs += [_lift(value, dtype, shape, site) for value in values]
    return tuple(inputs), dtype


def _where_dtype(op, values, op_name):
    tensors = [value for value in values if isinstance(value, Tensor)]
    scalars = [value for value in values if not isinstance(value, Tensor)]
    return _result_dtype(op, tensors, scalars, op_name)


def clamp(x, min=None, max=None) -> Tensor:  # noqa: A002
    """``min(max(x, min), max)``; NaN in ``x`` stays NaN, as in PyTorch."""
    if min is None and max is None:
        raise ValueError("clamp: at least one of min and max must be given")
    result = x
    if min is not None:
        result = apply("maximum", result, min)
    if max is not None:
        result = apply("minimum", result, max)
    return result


def realize(*tensors: Tensor) -> tuple[Tensor, ...] | Tensor:
    """Realize several tensors in one schedule: work they share is computed once."""
    by_backend: dict[str, list[Node]] = {}
    for tensor in tensors:
        if not isinstance(tensor, Tensor):
            raise TypeError(f"realize: expected flame.Tensor, got {type(tensor).__name__}")
        if not tensor.is_realized:
            by_backend.setdefault(tensor.backend, []).append(tensor.node)
    for backend_name, nodes in by_backend.items():
        realize_nodes(backend_name, nodes)
    return tensors[0] if len(tensors) == 1 else tensors


CUDNN_OPS = frozenset({"conv", "conv_data_grad", "conv_weight_grad", "attention"})


def apply_op(op_name: str, *inputs: Tensor, **attrs) -> Tensor:
    """Build a movement, reduce or library op over tensors. The op's ``shape_rule`` checks
    the inputs and gives the result type; errors name the op and the user's line."""
    site = builder_site()
    for value in inputs:
        if not isinstance(value, Tensor):
            raise _with_site(_operand_error(op_name, value), site)
    try:
        if len(inputs) == 1:  # the usual case (views, reductions)
            backend_name = inputs[0].backend
            nodes = (inputs[0].node,)
        else:
            backend_name = _common_backend(op_name, list(inputs))
            nodes = tuple([value.node for value in inputs])
        op = OPS.get(op_name) or get_op(op_name)
        dtype, shape = op.shape_rule(nodes, attrs)
    except (ShapeError, TypeError, ValueError, IndexError) as error:
        raise _with_site(error, site) from None
    ordered = tuple(attrs.items()) if len(attrs) < 2 else tuple(sorted(attrs.items()))
    node = Node(op_name, nodes, ordered, dtype, tuple(shape), site)
    if backend_name == "cuda" and op_name in CUDNN_OPS:
        from flame.runtime.library_cudnn import start_loading

        start_loading()  # cuDNN's start-up overlaps the rest of the trace and the compile
    return result(node, backend_name)


# Tensor's operators are the fast paths of flame/fast_paths.py, which installs them when
# imported; here, at the end, because it builds on ``Tensor``, ``apply`` and ``result``.
from flame import fast_paths  # noqa: E402, F401
