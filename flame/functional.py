"""Elementwise functions, as ``flame.op(x)`` and as ``x.op()``. Each forwards to the op
declared in the registry; this module adds only PyTorch's argument names and checks."""

from __future__ import annotations

from flame.tensor import Tensor, _fast_binary, _fast_unary, apply, clamp

UNARY = (
    "neg abs exp log log1p expm1 sqrt rsqrt sin cos tanh sigmoid relu silu erf floor ceil round "
    "sign reciprocal logical_not bitwise_not"
).split()
BINARY = (
    "add sub mul div floordiv remainder pow maximum minimum eq ne lt le gt ge "
    "bitwise_and bitwise_or bitwise_xor"
).split()


def _unary(name):
    function = _fast_unary(name)

    function.__name__ = function.__qualname__ = name
    function.__doc__ = f"Elementwise ``{name}`` (see the op registry)."
    return function


def _binary(name):
    function = _fast_binary(name)

    function.__name__ = function.__qualname__ = name
    function.__doc__ = f"Elementwise ``{name}`` with broadcasting and type promotion."
    return function


_FUNCTIONS = {name: _unary(name) for name in UNARY}
_FUNCTIONS.update({name: _binary(name) for name in BINARY})


def gelu(x, approximate: str = "none"):
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return apply("gelu", x, approximate=approximate)


def leaky_relu(x, negative_slope: float = 0.01):
    return apply("leaky_relu", x, negative_slope=float(negative_slope))


def softplus(x, beta: float = 1.0, threshold: float = 20.0):
    return apply("softplus", x, beta=float(beta), threshold=float(threshold))


def where(condition, x, y):
    return apply("where", condition, x, y)


_FUNCTIONS.update(gelu=gelu, leaky_relu=leaky_relu, softplus=softplus)
for _name, _function in _FUNCTIONS.items():
    if not hasattr(Tensor, _name):
        setattr(Tensor, _name, _function)
globals().update(_FUNCTIONS)
true_divide = _FUNCTIONS["div"]
negative = _FUNCTIONS["neg"]

__all__ = [*_FUNCTIONS, "where", "clamp", "true_divide", "negative"]
