"""Elementwise functions, as ``flame.op(x)`` and as ``x.op()``. Each forwards to the op
declared in the registry; this module adds only PyTorch's argument names and checks."""

from __future__ import annotations

import numbers

import ml_dtypes

import flame.tensor as _tensor_module
from flame.fast_paths import _fast_binary, _fast_unary
from flame.ir import dtypes
from flame.ir.node import user_site
from flame.tensor import Tensor, _with_site, apply

UNARY = (
    "neg abs exp log log1p expm1 sqrt rsqrt sin cos tanh sigmoid relu silu erf floor ceil round "
    "sign reciprocal logical_not bitwise_not erfinv exp2 log2 log10 asin acos atan sinh cosh "
    "tan asinh acosh atanh trunc"
).split()
BINARY = (
    "add sub mul floordiv remainder maximum minimum eq ne lt le gt ge "
    "bitwise_and bitwise_or bitwise_xor atan2 copysign fmod logaddexp "
    "bitwise_left_shift bitwise_right_shift clamp_min clamp_max"
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


def _refuse(error: Exception):
    return _with_site(error, user_site())


# --- predicates and nan_to_num ----------------------------------------------------------------
# built through ``apply``: the fast unary path keeps the input's dtype, these give bool


def isnan(x):
    return apply("isnan", x)


def isinf(x):
    return apply("isinf", x)


def isfinite(x):
    return apply("isfinite", x)


def nan_to_num(x, nan: float = 0.0, posinf=None, neginf=None):
    """NaN -> ``nan``, +inf -> ``posinf``, -inf -> ``neginf``; None: the largest finite value
    of ``x``'s dtype (65504 for float16), as PyTorch. Integers and bools pass unchanged."""
    if isinstance(x, Tensor) and x.dtype.is_float:
        largest = float(ml_dtypes.finfo(x.dtype.numpy).max)
        posinf = largest if posinf is None else float(posinf)
        neginf = -largest if neginf is None else float(neginf)
    return apply("nan_to_num", x, nan=float(nan), posinf=posinf, neginf=neginf)


# --- clamp --------------------------------------------------------------------------------------


def clamp(x, min=None, max=None) -> Tensor:  # noqa: A002 (PyTorch's names)
    """``min(max(x, min), max)`` as one op: NaN in ``x`` or a bound gives NaN, and the
    gradient passes where ``min <= x <= max``, the bounds included (as PyTorch)."""
    if min is None and max is None:
        raise _refuse(ValueError("clamp: at least one of min and max must be given"))
    if max is None:
        return apply("clamp_min", x, min)
    if min is None:
        return apply("clamp_max", x, max)
    return apply("clamp", x, min, max)


clip = clamp


# --- division and powers --------------------------------------------------------------------

_true_divide = _fast_binary("div")
_fast_pow = _fast_binary("pow")


def div(x, other, *, rounding_mode=None):
    """``x / other``; ``rounding_mode="trunc"`` rounds toward zero, ``"floor"`` down (then
    integers stay integers), as PyTorch. A rounded quotient has a zero gradient."""
    if rounding_mode is None:
        return _true_divide(x, other)
    if rounding_mode == "trunc":
        # fmod promotes, and refuses bools, as PyTorch's div does
        remainder = _FUNCTIONS["fmod"](x, other)
        if remainder.dtype.is_float:
            return _FUNCTIONS["trunc"](_true_divide(x, other))  # PyTorch's own formula
        return _FUNCTIONS["floordiv"](x - remainder, other)  # an exact multiple of other
    if rounding_mode == "floor":
        operands = [value.detach() if isinstance(value, Tensor) else value for value in (x, other)]
        quotient = _FUNCTIONS["floordiv"](*operands)
        if not quotient.dtype.is_float:
            return quotient
        # floordiv has no gradient rule: the quotient is built from detached operands and
        # tied back to them by sign(v) - sign(v), exactly 0 (sign(NaN) is 0), gradient 0
        for value in (x, other):
            if isinstance(value, Tensor) and value.dtype.is_float:
                link = _FUNCTIONS["sign"](value)
                quotient = quotient + (link - link)
        return quotient
    raise _refuse(
        ValueError(f"div: rounding_mode must be None, 'trunc' or 'floor', got {rounding_mode!r}")
    )


def pow(x, exponent):  # noqa: A001 (PyTorch's name)
    """``x ** exponent``. An integer tensor to a negative Python integer is refused, as in
    PyTorch (an integer tensor exponent gives 0 there, as C's integer division)."""
    if (
        isinstance(x, Tensor)
        and not x.dtype.is_float
        and isinstance(exponent, numbers.Integral)  # a Python or NumPy integer
        and not isinstance(exponent, bool)
        and exponent < 0
    ):
        raise _refuse(
            RuntimeError(
                "pow: Integers to negative integer powers are not allowed "
                f"({x.dtype.name}{list(x.shape)} ** {exponent})"
            )
        )
    return _fast_pow(x, exponent)


# --- composites with PyTorch's formulas ---------------------------------------------------------


def lerp(input, end, weight):  # noqa: A002
    """``input + weight * (end - input)``, as PyTorch computes it: from ``end`` where
    ``|weight| >= 0.5``, so weight 1 gives ``end`` exactly."""
    for value in (input, end, weight):
        if isinstance(value, Tensor) and not value.dtype.is_float:
            raise _refuse(TypeError(f"lerp: needs float tensors, got {value.dtype.name}"))
    difference = end - input
    if not isinstance(weight, Tensor):
        if abs(weight) < 0.5:
            return input + weight * difference
        return end - difference * (1.0 - weight)
    small = weight.abs() < 0.5
    return where(small, input + weight * difference, end - difference * (1.0 - weight))


def addcmul(input, tensor1, tensor2, *, value=1):  # noqa: A002
    """``input + value * tensor1 * tensor2``."""
    return input + value * tensor1 * tensor2


def addcdiv(input, tensor1, tensor2, *, value=1):  # noqa: A002
    """``input + value * tensor1 / tensor2``; integer division is refused, as in PyTorch."""
    if all(isinstance(t, Tensor) and not t.dtype.is_float for t in (tensor1, tensor2)):
        shown = f"{tensor1.dtype.name}{list(tensor1.shape)} / {tensor2.dtype.name}"
        raise _refuse(RuntimeError(f"addcdiv: integer division is not supported ({shown})"))
    return input + value * tensor1 / tensor2


def square(input):  # noqa: A002
    """``input * input`` (PyTorch's ``torch.square``; integer inputs stay integers)."""
    return input * input


def _float_operands(name: str, *values) -> list[Tensor]:
    """``values`` (flame tensors) cast to their promoted dtype, which must be a float one
    (PyTorch's ``hypot``, ``frac``: "not implemented for 'Long'")."""
    for value in values:
        if not isinstance(value, Tensor):
            raise _refuse(TypeError(f"{name}: expected a flame.Tensor, got {type(value).__name__}"))
    dimensioned = [value.dtype for value in values if value.ndim]
    zero_dim = [value.dtype for value in values if not value.ndim]
    common = dtypes.result_type(dimensioned, zero_dim, [])
    if not common.is_float:
        shown = " and ".join(f"{value.dtype.name}{list(value.shape)}" for value in values)
        raise _refuse(TypeError(f"{name}: needs float tensors, got {shown}"))
    return [value.to(common) for value in values]


def hypot(input, other):  # noqa: A002
    """``sqrt(input**2 + other**2)`` without overflow or underflow on the way, as C's
    ``hypot``: the larger magnitude times ``sqrt(1 + ratio**2)``; an infinite operand gives
    inf even beside a NaN. The gradient is ``input / hypot`` (NaN at the origin, as
    PyTorch's; NaN for both operands where one is infinite: PyTorch's is 0 for the finite
    one)."""
    x, y = _float_operands("hypot", input, other)
    magnitude_x, magnitude_y = x.abs(), y.abs()
    large = _FUNCTIONS["maximum"](magnitude_x, magnitude_y)
    small = _FUNCTIONS["minimum"](magnitude_x, magnitude_y)
    origin = large == 0.0
    ratio = small / where(origin, 1.0, large)
    scaled = large * (1.0 + ratio * ratio).sqrt()
    # at the origin 0, with sqrt's NaN gradient there; elsewhere sqrt(1), whose zero
    # cotangent stays 0 (sqrt(x*x + y*y) itself would turn it into 0 * inf = NaN where the
    # squares underflow)
    plain = where(origin, x * x + y * y, 1.0).sqrt()
    finite = where(origin, plain, scaled)
    infinite = isinf(x) | isinf(y)
    return where(infinite, float("inf"), finite)


def logit(input, eps=None):  # noqa: A002
    """``log(z / (1 - z))`` with ``z`` the input clamped to ``[eps, 1 - eps]`` (not clamped
    when ``eps`` is None or negative), as PyTorch: below ``eps`` gives ``eps``, above
    ``1 - eps`` gives ``1 - eps`` (in that order), and the gradient is 0 outside the range.
    Without ``eps`` the gradient outside [0, 1] is finite (PyTorch's is NaN; the value is NaN
    in both). Integer and bool inputs compute in float32."""
    if not isinstance(input, Tensor):
        raise _refuse(TypeError(f"logit: expected a flame.Tensor, got {type(input).__name__}"))
    x = input if input.dtype.is_float else input.to(dtypes.DEFAULT_FLOAT)
    if eps is not None and eps >= 0:
        low, high = float(eps), 1.0 - float(eps)
        x = where(x < low, low, where(x > high, high, x))
    return (x / (1.0 - x)).log()


def frac(input):  # noqa: A002
    """``input - trunc(input)``: the fractional part, with the input's sign; float only."""
    (x,) = _float_operands("frac", input)
    return x - _FUNCTIONS["trunc"](x)


_FUNCTIONS.update(gelu=gelu, leaky_relu=leaky_relu, softplus=softplus, square=square)
_FUNCTIONS.update(
    isnan=isnan, isinf=isinf, isfinite=isfinite, nan_to_num=nan_to_num, clip=clip,
    div=div, pow=pow, lerp=lerp, addcmul=addcmul, addcdiv=addcdiv,
)  # fmt: skip
_FUNCTIONS.update(hypot=hypot, logit=logit, frac=frac)
_FUNCTIONS["fix"] = _FUNCTIONS["trunc"]
_FUNCTIONS["sgn"] = _FUNCTIONS["sign"]  # the sign, for FLAME's real dtypes
_FUNCTIONS["floor_divide"] = _FUNCTIONS["floordiv"]
for _name, _function in _FUNCTIONS.items():
    if not hasattr(Tensor, _name):
        setattr(Tensor, _name, _function)
globals().update(_FUNCTIONS)
true_divide = _true_divide
divide = div
negative = _FUNCTIONS["neg"]

# Methods tensor.py defines too, replaced here so that they follow PyTorch at the edges:
# clamp's gradient at the bounds, div's rounding_mode, ``int_tensor ** -1`` refused.
# (flame/__init__.py imports ``clamp`` from flame.tensor after this module: the module
# attribute is pointed here as well until it imports it from here.)
Tensor.clamp = Tensor.clip = clamp
Tensor.div = Tensor.divide = div
Tensor.pow = Tensor.__pow__ = pow
_tensor_module.clamp = clamp
if not hasattr(Tensor, "__lshift__"):  # ``x << n`` and ``x >> n``, as PyTorch's shifts
    Tensor.__lshift__ = _fast_binary("bitwise_left_shift")
    Tensor.__rlshift__ = _fast_binary("bitwise_left_shift", reflected=True)
    Tensor.__rshift__ = _fast_binary("bitwise_right_shift")
    Tensor.__rrshift__ = _fast_binary("bitwise_right_shift", reflected=True)

__all__ = [
    *_FUNCTIONS, "where", "clamp", "true_divide", "divide", "negative",
]  # fmt: skip
