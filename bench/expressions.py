"""The computations the workloads time, each written once for every system.

An expression takes an ``ops`` namespace first (``gelu_tanh``, ``sigmoid``, ``tanh``, ``exp``) and
its input arrays after it; ``+``, ``-`` and ``*`` come from the arrays themselves. One definition
per workload means FLAME, PyTorch, ``cupy.fuse`` and the NumPy oracle compute the same function by
construction, and the PyTorch namespace spells each op the way a PyTorch user would.
"""

import math
from types import SimpleNamespace

GELU_TANH_SCALE = math.sqrt(2.0 / math.pi)
GELU_TANH_CUBIC = 0.044715


def ew_chain(ops, x, y):
    return ops.gelu_tanh(x * 1.5 + y) * ops.sigmoid(y) - 0.5 * x * x + ops.tanh(x - y)


def bias_gelu(ops, x, bias):
    return ops.gelu_tanh(x + bias)


TINY20_OPS = 20


def tiny20(ops, x, y):
    """Twenty elementwise ops; each keeps values in a range where the next stays finite."""
    value = x * y
    value = value + x
    value = ops.tanh(value)
    value = value * 0.5
    value = value + y
    value = ops.sigmoid(value)
    value = value - x
    value = ops.exp(value)
    value = value * y
    value = ops.tanh(value)
    value = value + 1.0
    value = value * x
    value = ops.sigmoid(value)
    value = value * value
    value = value - y
    value = ops.tanh(value)
    value = ops.exp(value)
    value = value * 0.25
    value = value + x
    return ops.sigmoid(value)


def flame_ops(flame):
    return SimpleNamespace(
        gelu_tanh=lambda value: flame.gelu(value, approximate="tanh"),
        sigmoid=flame.sigmoid,
        tanh=flame.tanh,
        exp=flame.exp,
    )


def torch_ops(torch):
    functional = torch.nn.functional
    return SimpleNamespace(
        gelu_tanh=lambda value: functional.gelu(value, approximate="tanh"),
        sigmoid=torch.sigmoid,
        tanh=torch.tanh,
        exp=torch.exp,
    )


def array_ops(xp):
    """NumPy or CuPy; inside ``cupy.fuse`` the same calls trace into one kernel."""

    def gelu_tanh(value):
        inner = GELU_TANH_SCALE * (value + GELU_TANH_CUBIC * value * value * value)
        return 0.5 * value * (1.0 + xp.tanh(inner))

    def sigmoid(value):
        return 1.0 / (1.0 + xp.exp(-value))

    return SimpleNamespace(gelu_tanh=gelu_tanh, sigmoid=sigmoid, tanh=xp.tanh, exp=xp.exp)


def bind(expression, ops):
    """A plain function of the inputs alone, named after the expression.

    ``cupy.fuse`` names its kernel after the function and ``torch.compile`` wants a callable of
    the tensors only, so the namespace is closed over rather than passed.
    """

    def call(*inputs):
        return expression(ops, *inputs)

    call.__name__ = expression.__name__
    call.__qualname__ = expression.__name__
    return call
