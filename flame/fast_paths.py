"""The host fast paths of lazy mode: elementwise ops built straight into IR nodes.

``x + y``, ``-x``, ``flame.exp(x)``, ... are the common case of tracing: one dtype the op takes
as it is, equal shapes (or a zero-dimensional side, or a Python number). The builders here
make those nodes without ``apply``'s promotion and broadcasting machinery (and without the
``Node``/``Tensor`` constructors), reading the user's line from the frame's ``SiteMark``;
anything else goes to ``flame.tensor.apply``, which also reports the errors. Importing this
module installs the builders as ``Tensor``'s arithmetic, bitwise and comparison operators
(flame/tensor.py imports it at its end); flame/functional.py makes its elementwise functions
with them. tests/test_host_cost.py checks that they build what ``apply`` builds.
"""

from __future__ import annotations

import sys

from flame.ir import dtypes
from flame.ir.infer import NAN
from flame.ir.node import Node, SiteMark, caller_frame, frame_site
from flame.ir.ops import OPS
from flame.tensor import Tensor, apply, grad_enabled, result


def _fast_dtypes(op) -> frozenset:
    """The dtypes an op's fast path takes as they are: the op accepts them and its promotion
    keeps them (``int_to_float`` ops take floats only)."""
    if op.promotion not in ("default", "always_bool", "int_to_float"):
        return frozenset()
    return frozenset(
        dtype
        for dtype in dtypes.ALL
        if op.accepts(dtype.category) and (op.promotion != "int_to_float" or dtype.is_float)
    )


def _fast_unary(op_name: str):
    """``op(x)`` built straight into a node when ``x`` is a tensor of a dtype the op takes as
    it is; anything else goes through ``apply`` (which also reports errors). The caller's
    frame is the user's line unless it is FLAME's own code."""
    op = OPS[op_name]
    accepted = _fast_dtypes(op)
    # names the builder reads every call, bound here (closure cells read faster than globals)
    getframe, site_of, grad_on = sys._getframe, frame_site, grad_enabled.get
    caller, site_mark, new = caller_frame, SiteMark, object.__new__
    node_type, tensor_type = Node, Tensor

    def function(x):
        if type(x) is tensor_type:
            node = x.node
            dtype = node.dtype
            if dtype in accepted:
                try:
                    frame = caller(None)  # the caller's frame without an audited call
                except (ValueError, StopIteration):  # another thread is in it now; closed
                    frame = getframe(1)
                # the user's line: from the frame's SiteMark where an earlier op left it
                # (read here, not through a call: one call per op is ~10 % of the build)
                sites = frame.f_trace if frame is not None else None
                site = sites.get(frame.f_lasti) if type(sites) is site_mark else None
                if site is None:
                    site = site_of(frame)
                # Node(...) and, below, Tensor(...) without their __init__ calls: ~0.1 us
                # each on Python 3.12. Every slot is set (tests/test_host_cost.py checks
                # these against Node(...) and Tensor(...)).
                made = new(node_type)
                made.op = op_name
                made.inputs = (node,)
                made.attrs = ()
                made.dtype = dtype
                made.shape = node.shape
                made.site = site
                made.buffer = made.grad_info = made._hash = None
                if grad_on():
                    out = new(tensor_type)
                    out.node = made
                    out.backend = x.backend
                    out.grad = None
                    return out
                return result(made, x.backend)
        return apply(op_name, x)

    return function


def _fast_binary(op_name: str, reflected: bool = False):
    """``op(a, b)`` built straight into a node in the common cases: one dtype the op takes as
    it is on one backend, with equal shapes or one side zero-dimensional (broadcast by an
    ``expand`` node, as ``apply`` does), or a float tensor with a Python int/float (an
    implicit-broadcast constant). Anything else goes through ``apply``, which promotes,
    broadcasts and reports errors. ``reflected``: the tensor is the right operand.
    Subclasses (``nn.Parameter``) take the fast path too: ``apply`` treats them alike."""
    op = OPS[op_name]
    accepted = _fast_dtypes(op)
    out_bool = op.out_bool
    getframe, site_of, grad_on = sys._getframe, frame_site, grad_enabled.get
    caller, site_mark, new = caller_frame, SiteMark, object.__new__
    node_type, tensor_type = Node, Tensor  # bound here, as in _fast_unary

    def function(x, other):
        if type(x) is tensor_type or isinstance(x, tensor_type):
            node = x.node
            dtype = node.dtype
            if dtype in accepted:
                kind = type(other)
                shape = node.shape
                widen = None  # the zero-dimensional side, expanded to the other's shape
                if kind is tensor_type or isinstance(other, tensor_type):
                    other_node = other.node
                    if other_node.dtype is not dtype or other.backend != x.backend:
                        other_node = None
                    elif other_node.shape != shape:
                        if not other_node.shape:
                            widen = other_node
                        elif not shape:
                            widen, shape = node, other_node.shape
                        else:
                            other_node = None
                elif (kind is float or kind is int) and dtype.category == 2:
                    value = float(other)  # one NaN object (infer.canonical_float), inline
                    value = value if value == value else NAN
                    other_node = node_type("const", (), (("value", value),), dtype, (), None)
                else:
                    other_node = None
                if other_node is not None:
                    try:
                        frame = caller(None)  # as in _fast_unary
                    except (ValueError, StopIteration):
                        frame = getframe(1)
                    sites = frame.f_trace if frame is not None else None
                    site = sites.get(frame.f_lasti) if type(sites) is site_mark else None
                    if site is None:
                        site = site_of(frame)
                    if widen is not None:  # as apply's _lift
                        wide = node_type(
                            "expand", (widen,), (("shape", shape),), dtype, shape, site
                        )
                        if widen is node:
                            node = wide
                        else:
                            other_node = wide
                    made = new(node_type)  # as in _fast_unary
                    made.op = op_name
                    made.inputs = (other_node, node) if reflected else (node, other_node)
                    made.attrs = ()
                    made.dtype = dtypes.bool_ if out_bool else dtype
                    made.shape = shape
                    made.site = site
                    made.buffer = made.grad_info = made._hash = None
                    if grad_on():
                        out = new(tensor_type)
                        out.node = made
                        out.backend = x.backend
                        out.grad = None
                        return out
                    return result(made, x.backend)
        if reflected:
            return apply(op_name, other, x)
        return apply(op_name, x, other)

    return function


for _dunder, _op in (
    ("add", "add"), ("sub", "sub"), ("mul", "mul"), ("truediv", "div"),
    ("floordiv", "floordiv"), ("mod", "remainder"), ("pow", "pow"),
    ("and", "bitwise_and"), ("or", "bitwise_or"), ("xor", "bitwise_xor"),
):  # fmt: skip
    setattr(Tensor, f"__{_dunder}__", _fast_binary(_op))
    setattr(Tensor, f"__r{_dunder}__", _fast_binary(_op, reflected=True))
for _dunder, _op in (
    ("eq", "eq"),
    ("ne", "ne"),
    ("lt", "lt"),
    ("le", "le"),
    ("gt", "gt"),
    ("ge", "ge"),
):
    setattr(Tensor, f"__{_dunder}__", _fast_binary(_op))
Tensor.__hash__ = object.__hash__
Tensor.__neg__ = _fast_unary("neg")
