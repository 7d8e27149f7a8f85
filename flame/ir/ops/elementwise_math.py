"""More elementwise ops with PyTorch's names: inverse and hyperbolic trigonometry, base-2
and base-10 logs, IEEE predicates, rounding toward zero, clamping, C's remainder, shifts.

Declared as in ``elementwise.py`` (one ``def_op`` each, its NumPy reference beside its CUDA
expression, its vjp below); that module imports this one, so the registry holds both.
"""

from __future__ import annotations

import math

import numpy as np

from flame.ir.ops.elementwise import NONZERO, POSITIVE, _binary, _elementwise, _unary_float
from flame.ir.ops.registry import def_helper, def_op, def_vjp

_LN2, _LN10 = math.log(2.0), math.log(10.0)
_UNIT = ((-0.9, 0.9),)  # inside (-1, 1), where asin, acos, atanh and erfinv are finite


def _erfinv_ref(x):
    """erf's inverse in float64: Winitzki's closed form, then Newton steps on math.erf."""
    erf = np.vectorize(math.erf, otypes=[np.float64])
    value = x.astype(np.float64)
    with np.errstate(all="ignore"):
        log_term = np.log((1.0 - value) * (1.0 + value))
        spread = 2.0 / (math.pi * 0.147) + 0.5 * log_term
        guess = np.copysign(np.sqrt(np.sqrt(spread * spread - log_term / 0.147) - spread), value)
        inside = np.abs(value) < 1.0
        guess = np.where(inside, guess, 0.0)
        for _ in range(4):
            slope = 2.0 / math.sqrt(math.pi) * np.exp(-guess * guess)
            guess = guess - (erf(guess) - np.where(inside, value, 0.0)) / slope
        edge = np.where(np.abs(value) == 1.0, np.copysign(np.inf, value), np.nan)
        result = np.where(inside, guess, edge)
    return np.where(value == 0.0, value, result).astype(x.dtype)  # keeps -0.0


_unary_float("erfinv", _erfinv_ref, "erfinvf({0})", _UNIT)
_unary_float("exp2", np.exp2, "exp2f({0})")
_unary_float("log2", np.log2, "log2f({0})", POSITIVE)
_unary_float("log10", np.log10, "log10f({0})", POSITIVE)
_unary_float("asin", np.arcsin, "asinf({0})", _UNIT)
_unary_float("acos", np.arccos, "acosf({0})", _UNIT)
_unary_float("atan", np.arctan, "atanf({0})")
_unary_float("sinh", np.sinh, "sinhf({0})")
_unary_float("cosh", np.cosh, "coshf({0})")
_unary_float("tan", np.tan, "tanf({0})", ((-1.2, 1.2),))
_unary_float("asinh", np.arcsinh, "asinhf({0})")
_unary_float("acosh", np.arccosh, "acoshf({0})", ((1.1, 4.0),))
_unary_float("atanh", np.arctanh, "atanhf({0})", _UNIT)

# trunc keeps integers as they are (PyTorch: same dtype; bool is refused)
_elementwise("trunc", np.trunc, {"f": "truncf({0})", "i": "{0}"}, categories="if")


def _predicate(test, integer_answer: bool):
    def ref(x):
        if x.dtype.kind != "f":
            return np.full(x.shape, integer_answer)
        return test(x)

    return ref


for _name, _test, _expression, _integer_answer in (
    ("isnan", np.isnan, "isnan({0})", False),
    ("isinf", np.isinf, "isinf({0})", False),
    ("isfinite", np.isfinite, "isfinite({0})", True),
):
    _constant = "true" if _integer_answer else "false"
    _elementwise(
        _name, _predicate(_test, _integer_answer),
        {"f": _expression, "i": _constant, "b": _constant},
        out_bool=True, promotion="always_bool", differentiable=False,
    )  # fmt: skip


def _nan_to_num_ref(x, nan=0.0, posinf=None, neginf=None):
    if x.dtype.kind != "f":
        return x
    largest = float(np.finfo(x.dtype).max)
    high = largest if posinf is None else posinf
    low = -largest if neginf is None else neginf
    return np.where(np.isnan(x), nan, np.where(np.isinf(x), np.where(x > 0, high, low), x))


# The front end (flame.functional.nan_to_num) always passes the three values, with None
# replaced by the largest finite value of the tensor's dtype (65504 for float16).
_elementwise(
    "nan_to_num", _nan_to_num_ref,
    {"f": "(isnan({0}) ? {nan} : (isinf({0}) ? ({0} > 0.0f ? {posinf} : {neginf}) : {0}))",
     "i": "{0}", "b": "{0}"},
    attrs={"nan": 0.0, "posinf": None, "neginf": None},
)  # fmt: skip

_binary("atan2", np.arctan2, {"f": "atan2f({0}, {1})"}, promotion="int_to_float")
_binary("copysign", np.copysign, {"f": "copysignf({0}, {1})"}, promotion="int_to_float")
# C's remainder (the dividend's sign); integer division by zero is undefined on the GPU.
_binary(
    "fmod", np.fmod, {"f": "fmodf({0}, {1})", "i": "({0} % {1})"}, categories="if",
    domains=((-6.0, 6.0), NONZERO),
)  # fmt: skip

def_helper(
    "flame_logaddexp",
    """
__device__ __forceinline__ float flame_logaddexp(float a, float b) {
    if (isinf(a) && a == b) return a;  // inf - inf would give NaN
    const float high = a > b ? a : b;
    return high + log1pf(expf(-fabsf(a - b)));
}""",
)
_binary(
    "logaddexp", np.logaddexp, {"f": "flame_logaddexp({0}, {1})"}, categories="f",
    helpers=("flame_logaddexp",),
)  # fmt: skip

# Shifts as PyTorch defines them past the width: a left shift by a negative amount or by
# the width or more gives 0; a right shift so far keeps only the sign (0 for unsigned types).
def_helper(
    "flame_shift",
    """
template <typename T>
__device__ __forceinline__ T flame_shl(T a, T b) {
    if (b < 0 || (long long)b >= (long long)(sizeof(T) * 8)) return 0;
    return (T)((unsigned long long)a << b);
}
template <typename T>
__device__ __forceinline__ T flame_shr(T a, T b) {
    const long long width = sizeof(T) * 8;
    const long long last = ((T)(-1) < (T)0) ? width - 1 : width;
    const long long amount = (b < 0 || (long long)b > last) ? last : (long long)b;
    return (T)((long long)a >> amount);
}""",
)


def _shift_left_ref(a, b):
    bits = a.dtype.itemsize * 8
    inside = (b >= 0) & (b < bits)
    shifted = np.left_shift(a, np.where(inside, b, 0).astype(a.dtype))
    return np.where(inside, shifted, 0).astype(a.dtype)


def _shift_right_ref(a, b):
    bits = a.dtype.itemsize * 8
    if a.dtype.kind == "u":
        shifted = np.right_shift(a, np.where(b >= bits, 0, b).astype(a.dtype))
        return np.where(b >= bits, 0, shifted).astype(a.dtype)
    amount = np.where((b < 0) | (b > bits - 1), bits - 1, b).astype(a.dtype)
    return np.right_shift(a, amount)


_binary(
    "bitwise_left_shift", _shift_left_ref, {"i": "flame_shl({0}, {1})"}, categories="i",
    helpers=("flame_shift",), differentiable=False,
)  # fmt: skip
_binary(
    "bitwise_right_shift", _shift_right_ref, {"i": "flame_shr({0}, {1})"}, categories="i",
    helpers=("flame_shift",), differentiable=False,
)  # fmt: skip

# clamp is one op (not maximum then minimum) so that its backward is PyTorch's: the gradient
# passes where min <= x <= max, bounds included; NaN anywhere gives NaN, as in PyTorch.
def_op(
    "clamp", "elementwise", 3,
    ref=lambda x, low, high: np.minimum(np.maximum(x, low), high),
    cuda={"f": "flame_min(flame_max({0}, {1}), {2})",
          "i": "flame_min(flame_max({0}, {1}), {2})"},
    categories="if", helpers=("flame_minmax",),
)  # fmt: skip
_binary(
    "clamp_min", np.maximum,
    {"f": "flame_max({0}, {1})", "i": "flame_max({0}, {1})", "b": "({0} || {1})"},
    helpers=("flame_minmax",),
)  # fmt: skip
_binary(
    "clamp_max", np.minimum,
    {"f": "flame_min({0}, {1})", "i": "flame_min({0}, {1})", "b": "({0} && {1})"},
    helpers=("flame_minmax",),
)  # fmt: skip


# --- backward rules (PyTorch's formulas, so edge values give PyTorch's numbers) --------------
def _clamp_vjp(F, g, out, x, low, high):
    inside = (x >= low) & (x <= high)
    below = (x < low) & (low < high)
    above = (x > high) | (high < low)
    return F.where(inside, g, 0.0), F.where(below, g, 0.0), F.where(above, g, 0.0)


def _atan2_vjp(F, g, out, y, x):
    """d atan2(y, x) = (x, -y) / (x^2 + y^2); 0 where the denominator is 0 (PyTorch's
    choice at the origin, and where the squares underflow)."""
    squares = y * y + x * x
    reciprocal = F.where(squares == 0.0, 0.0, 1.0 / F.where(squares == 0.0, 1.0, squares))
    return g * x * reciprocal, g * -y * reciprocal


def _rsqrt(t):
    return 1.0 / t.sqrt()


for _name, _rule in {
    "erfinv": lambda F, g, out, x: (g * 0.886226925452758 * F.exp(out * out),),
    "exp2": lambda F, g, out, x: (g * out * _LN2,),
    "log2": lambda F, g, out, x: (g / (x * _LN2),),
    "log10": lambda F, g, out, x: (g / (x * _LN10),),
    "asin": lambda F, g, out, x: (g * _rsqrt(1.0 - x * x),),
    "acos": lambda F, g, out, x: (-g * _rsqrt(1.0 - x * x),),
    "atan": lambda F, g, out, x: (g / (x * x + 1.0),),
    "sinh": lambda F, g, out, x: (g * x.cosh(),),
    "cosh": lambda F, g, out, x: (g * x.sinh(),),
    "tan": lambda F, g, out, x: (g * (out * out + 1.0),),
    "asinh": lambda F, g, out, x: (g * _rsqrt(x * x + 1.0),),
    "acosh": lambda F, g, out, x: (g * _rsqrt(x * x - 1.0),),
    "atanh": lambda F, g, out, x: (g / (1.0 - x * x),),
    "trunc": lambda F, g, out, x: (g * 0.0,),
    "nan_to_num": lambda F, g, out, x, nan=0.0, posinf=None, neginf=None: (
        F.where(x.isfinite(), g, 0.0),
    ),
    "atan2": _atan2_vjp,
    "copysign": lambda F, g, out, x, y: (g * F.where(x == 0.0, 0.0, out / x), g * 0.0),
    "fmod": lambda F, g, out, x, y: (g, -g * (x / y).trunc()),
    "logaddexp": lambda F, g, out, x, y: (g / (F.exp(y - x) + 1.0), g / (F.exp(x - y) + 1.0)),
    "clamp": _clamp_vjp,
    "clamp_min": lambda F, g, out, x, low: (F.where(x >= low, g, 0.0), F.where(x < low, g, 0.0)),
    "clamp_max": lambda F, g, out, x, high: (
        F.where(x <= high, g, 0.0),
        F.where(x > high, g, 0.0),
    ),
}.items():
    def_vjp(_name, _rule)
