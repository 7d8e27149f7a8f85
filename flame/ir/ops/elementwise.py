"""Elementwise ops: one declaration each (NumPy reference beside its CUDA expression).

Float expressions run in ``float`` (float16/bfloat16 are computed in float32); integer
expressions in ``int`` / ``long long``; bool expressions in ``bool``.
"""

from __future__ import annotations

import math

import numpy as np

from flame.ir.ops.registry import def_helper, def_op, def_vjp

POSITIVE = ((0.1, 4.0),)
NONZERO = (-3.0, 3.0, "nonzero")


def _unary_float(name, ref, cuda, domains=((-3.0, 3.0),), f16=None, **extra):
    expressions = {"f": cuda} if f16 is None else {"f": cuda, "f16": f16}
    return def_op(
        name, "elementwise", 1, ref=ref, cuda=expressions, promotion="int_to_float",
        domains=domains, **extra,
    )  # fmt: skip


# ``f16``: the expression where the result is float16/bfloat16 (registry.py): the hardware
# exp2 (relative error ~2^-21 for |x| < 88, ~1000x below a float16 ulp) instead of expf's
# accurate sequence. Measured on the H100: the bf16 MLP's GELU backward, which computes an
# exp per element, 300 -> 288 us (notes/probes/gelu_kernels.py).
_unary_float("exp", np.exp, "expf({0})", f16="__expf({0})")
_unary_float("log", np.log, "logf({0})", POSITIVE)
_unary_float("log1p", np.log1p, "log1pf({0})", ((-0.9, 4.0),))
_unary_float("expm1", np.expm1, "expm1f({0})")
_unary_float("sqrt", np.sqrt, "sqrtf({0})", POSITIVE)
_unary_float("rsqrt", lambda x: 1 / np.sqrt(x), "rsqrtf({0})", POSITIVE)
_unary_float("sin", np.sin, "sinf({0})")
_unary_float("cos", np.cos, "cosf({0})")
_unary_float("tanh", np.tanh, "tanhf({0})")
# sigmoid-shaped ops use the hardware exp2 and approximate division: a few ulp of float32 and
# a fraction of the instructions of expf + IEEE division (they decide whether long fused chains
# stay memory-bound). A huge denominator gives 0, which is the right limit here.
_unary_float("sigmoid", lambda x: 1 / (1 + np.exp(-x)), "__fdividef(1.0f, 1.0f + __expf(-{0}))")
_unary_float("silu", lambda x: x / (1 + np.exp(-x)), "__fdividef({0}, 1.0f + __expf(-{0}))")
_unary_float("reciprocal", lambda x: 1 / x, "(1.0f / {0})", (NONZERO,))

_erf = np.vectorize(math.erf, otypes=[np.float64])


def _gelu_ref(x, approximate="none"):
    if approximate == "tanh":
        inner = math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)
        return 0.5 * x * (1 + np.tanh(inner))
    return (0.5 * x * (1 + _erf(x.astype(np.float64) / math.sqrt(2)))).astype(x.dtype)


def_helper(
    "flame_gelu_none",
    """
__device__ __forceinline__ float flame_gelu_none(float x) {
    return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
}""",
)
def_helper(
    "flame_gelu_none_16",
    """
__device__ __forceinline__ float flame_gelu_none_16(float x) {
    // For 16-bit results: 1 + erf(x / sqrt 2) from Abramowitz-Stegun 7.1.26 on the hardware
    // exp2, about half erff's instructions. Absolute error < 1.5e-7, the order of 1 + erff's
    // own rounding near erf = -1; so, as with erff, the far tail (x < -4, |gelu| < 1e-4) is
    // right in absolute terms only.
    const float a = fabsf(x) * 0.70710678118654752f;
    const float t = __fdividef(1.0f, 1.0f + 0.3275911f * a);
    const float tail = t * (0.254829592f + t * (-0.284496736f + t * (1.421413741f
                     + t * (-1.453152027f + t * 1.061405429f)))) * __expf(-a * a);
    return 0.5f * x * (x < 0.0f ? tail : 2.0f - tail);
}""",
)
def_helper(
    "flame_gelu_tanh",
    """
__device__ __forceinline__ float flame_gelu_tanh(float x) {
    // 0.5 * x * (1 + tanh(u)) == x * sigmoid(2u): no tanhf, no cancellation near -inf
    const float inner = 0.79788456080286536f * (x + 0.044715f * x * x * x);
    return __fdividef(x, 1.0f + __expf(-2.0f * inner));
}""",
)
def_helper(
    "flame_gelu_tanh_16",
    """
__device__ __forceinline__ float flame_gelu_tanh_16(float x) {
    return flame_gelu_tanh(x);  // already built on the hardware exp2
}""",
)
_unary_float(
    "gelu", _gelu_ref, "flame_gelu_{approximate}({0})",
    f16="flame_gelu_{approximate}_16({0})",
    helpers=("flame_gelu_none", "flame_gelu_none_16", "flame_gelu_tanh", "flame_gelu_tanh_16"),
    attrs={"approximate": "none"},
    attr_samples=({"approximate": "none"}, {"approximate": "tanh"}),
)  # fmt: skip
_unary_float(
    "softplus",
    lambda x, beta=1.0, threshold=20.0: np.where(
        x * beta > threshold, x, np.log1p(np.exp(np.minimum(x * beta, threshold))) / beta
    ),
    "({0} * {beta} > {threshold} ? {0} : log1pf(expf({0} * {beta})) / {beta})",
    attrs={"beta": 1.0, "threshold": 20.0},
    attr_samples=({"beta": 1.0, "threshold": 20.0}, {"beta": 2.0, "threshold": 1.0}),
)


def _elementwise(name, ref, cuda, arity=1, **extra):
    return def_op(name, "elementwise", arity, ref=ref, cuda=cuda, **extra)


_elementwise("neg", np.negative, {"f": "(-{0})", "i": "(-{0})"}, categories="if")
# the same values in memory of their own (``clone``): no pass folds it away, so a realized
# clone never shares the memory of its input (as ``x * 1`` would, once simplified to x)
_elementwise("copy", lambda x: np.array(x, copy=True), {"f": "{0}", "i": "{0}", "b": "{0}"})
_elementwise(
    "abs", np.abs, {"f": "fabsf({0})", "i": "({0} < 0 ? -{0} : {0})", "b": "{0}"},
)  # fmt: skip
_elementwise(
    "relu", lambda x: np.where(x < 0, np.zeros_like(x), x),
    {"f": "({0} < 0.0f ? 0.0f : {0})", "i": "({0} < 0 ? 0 : {0})"}, categories="if",
)  # fmt: skip
_elementwise(
    "leaky_relu",
    lambda x, negative_slope=0.01: np.where(x < 0, x * negative_slope, x),
    {"f": "({0} < 0.0f ? {0} * {negative_slope} : {0})"},
    promotion="int_to_float", categories="f", attrs={"negative_slope": 0.01},
    attr_samples=({"negative_slope": 0.01}, {"negative_slope": 0.2}),
)  # fmt: skip
_elementwise("floor", np.floor, {"f": "floorf({0})", "i": "{0}"}, categories="if")
_elementwise("ceil", np.ceil, {"f": "ceilf({0})", "i": "{0}"}, categories="if")
# rintf rounds half to even, as torch.round and np.round do.
_elementwise("round", np.round, {"f": "rintf({0})", "i": "{0}"}, categories="if")


def _sign_ref(x):
    if x.dtype == np.bool_:
        return x
    return np.where(np.isnan(x), 0, np.sign(x)).astype(x.dtype)  # sign(NaN) = 0, as PyTorch


_elementwise(
    "sign", _sign_ref,
    {"f": "(float)(({0} > 0.0f) - ({0} < 0.0f))", "i": "(({0} > 0) - ({0} < 0))", "b": "{0}"},
    differentiable=True,
)  # fmt: skip
_elementwise("logical_not", np.logical_not, {"b": "(!{0})"}, categories="b")
_elementwise("bitwise_not", np.invert, {"i": "(~{0})", "b": "(!{0})"}, categories="ib")


def _binary(name, ref, cuda, **extra):
    return def_op(name, "elementwise", 2, ref=ref, cuda=cuda, **extra)


_binary("add", np.add, {"f": "({0} + {1})", "i": "({0} + {1})", "b": "({0} || {1})"})
_binary("sub", np.subtract, {"f": "({0} - {1})", "i": "({0} - {1})"}, categories="if")
_binary("mul", np.multiply, {"f": "({0} * {1})", "i": "({0} * {1})", "b": "({0} && {1})"})
_binary(
    "div", np.true_divide, {"f": "({0} / {1})"}, promotion="int_to_float",
    domains=((-3.0, 3.0), NONZERO),
)  # fmt: skip

# Floor division and remainder follow Python (and NumPy, and PyTorch): the quotient is
# rounded down and the remainder takes the divisor's sign. Integer division by zero is
# undefined on the GPU.
def_helper(
    "flame_floordiv",
    """
__device__ __forceinline__ float flame_floordiv(float a, float b) {
    if (b == 0.0f) return a / b;  // inf, -inf or NaN, as NumPy and PyTorch
    const float mod = fmodf(a, b);
    float div = (a - mod) / b;
    if (mod != 0.0f && ((b < 0.0f) != (mod < 0.0f))) div -= 1.0f;
    if (div == 0.0f) return copysignf(0.0f, a / b);
    const float floored = floorf(div);
    return (div - floored > 0.5f) ? floored + 1.0f : floored;
}
template <typename T>
__device__ __forceinline__ T flame_floordiv(T a, T b) {
    T quotient = a / b;
    if ((a % b != 0) && ((a < 0) != (b < 0))) quotient -= 1;
    return quotient;
}""",
)
def_helper(
    "flame_remainder",
    """
__device__ __forceinline__ float flame_remainder(float a, float b) {
    float mod = fmodf(a, b);
    if (mod != 0.0f && ((b < 0.0f) != (mod < 0.0f))) mod += b;
    return mod;
}
template <typename T>
__device__ __forceinline__ T flame_remainder(T a, T b) {
    T mod = a % b;
    if (mod != 0 && ((mod < 0) != (b < 0))) mod += b;
    return mod;
}""",
)
_binary(
    "floordiv", np.floor_divide,
    {"f": "flame_floordiv({0}, {1})", "i": "flame_floordiv({0}, {1})"},
    categories="if", helpers=("flame_floordiv",), differentiable=False,
    domains=((-6.0, 6.0), NONZERO),
)  # fmt: skip
_binary(
    "remainder", np.remainder,
    {"f": "flame_remainder({0}, {1})", "i": "flame_remainder({0}, {1})"},
    categories="if", helpers=("flame_remainder",), domains=((-6.0, 6.0), NONZERO),
)  # fmt: skip
def_helper(
    "flame_ipow",
    """
template <typename T>
__device__ __forceinline__ T flame_ipow(T base, T exponent) {
    if (exponent < 0) return base == 1 ? 1 : (base == -1 ? ((exponent & 1) ? -1 : 1) : 0);
    T result = 1;
    while (exponent) {
        if (exponent & 1) result *= base;
        base *= base;
        exponent >>= 1;
    }
    return result;
}""",
)


def _pow_ref(base, exponent):
    if base.dtype.kind != "i":
        return np.power(base, exponent)
    # integer powers: a negative exponent gives 0 unless the base is 1 or -1 (as flame_ipow)
    negative = exponent < 0
    result = np.power(base, np.where(negative, 0, exponent))
    parity = np.where(np.abs(exponent) % 2 == 1, -1, 1)
    return np.where(negative, np.where(base == 1, 1, np.where(base == -1, parity, 0)), result)


# Sampled exponents are not negative: an integer tensor to a negative Python integer is
# refused (flame.functional.pow); negative exponents are tested in tests/test_edges.py.
_binary(
    "pow", _pow_ref, {"f": "powf({0}, {1})", "i": "flame_ipow({0}, {1})"},
    categories="if", helpers=("flame_ipow",), domains=((0.1, 3.0), (0.0, 2.0)),
)  # fmt: skip

# NaN propagates through maximum/minimum from either side, as in PyTorch (fmaxf would drop it).
def_helper(
    "flame_minmax",
    """
__device__ __forceinline__ float flame_max(float a, float b) { return (a != a || a > b) ? a : b; }
__device__ __forceinline__ float flame_min(float a, float b) { return (a != a || a < b) ? a : b; }
template <typename T> __device__ __forceinline__ T flame_max(T a, T b) { return a > b ? a : b; }
template <typename T> __device__ __forceinline__ T flame_min(T a, T b) { return a < b ? a : b; }""",
)
_binary(
    "maximum", np.maximum,
    {"f": "flame_max({0}, {1})", "i": "({0} > {1} ? {0} : {1})", "b": "({0} || {1})"},
    helpers=("flame_minmax",),
)  # fmt: skip
_binary(
    "minimum", np.minimum,
    {"f": "flame_min({0}, {1})", "i": "({0} < {1} ? {0} : {1})", "b": "({0} && {1})"},
    helpers=("flame_minmax",),
)  # fmt: skip

for _name, _ufunc, _symbol in (
    ("eq", np.equal, "=="),
    ("ne", np.not_equal, "!="),
    ("lt", np.less, "<"),
    ("le", np.less_equal, "<="),
    ("gt", np.greater, ">"),
    ("ge", np.greater_equal, ">="),
):
    _expression = "({0} %s {1})" % _symbol
    _binary(
        _name, _ufunc, {"f": _expression, "i": _expression, "b": _expression},
        out_bool=True, promotion="always_bool", differentiable=False,
    )  # fmt: skip

for _name, _ufunc, _symbol in (
    ("bitwise_and", np.bitwise_and, "&"),
    ("bitwise_or", np.bitwise_or, "|"),
    ("bitwise_xor", np.bitwise_xor, "^"),
):
    _expression = "({0} %s {1})" % _symbol
    _binary(
        _name, _ufunc, {"i": _expression, "b": _expression}, categories="ib",
        differentiable=False,
    )  # fmt: skip

def_op(
    "where", "elementwise", 3,
    ref=lambda condition, a, b: np.where(condition, a, b),
    cuda={"f": "({0} ? {1} : {2})", "i": "({0} ? {1} : {2})", "b": "({0} ? {1} : {2})"},
    promotion="where",
)  # fmt: skip

# cast: the expression depends on both dtypes, so codegen spells it (see codegen/spec.py);
# the declaration still owns its reference and dtype rule.
def_op(
    "cast", "elementwise", 1, ref=lambda x, dtype=None: x, promotion="none",
    attrs={"dtype": None},
)  # fmt: skip

# identities that matter to autograd only: ``detach`` stops gradients; ``barrier(x, after)``
# keeps a recomputation (checkpoint) apart from the forward values it repeats (its token
# differs) and, reading ``after`` (a broadcast element of the incoming gradient) without using
# it, keeps it from being scheduled before the backward needs it.
def_op(
    "detach", "elementwise", 1, ref=lambda x: x,
    cuda={"f": "{0}", "i": "{0}", "b": "{0}"}, differentiable=False, internal=True,
)  # fmt: skip
def_op(
    "barrier", "elementwise", 2, ref=lambda x, after, token=None: x,
    cuda={"f": "{0}", "i": "{0}", "b": "{0}"}, attrs={"token": None}, internal=True,
)  # fmt: skip
def_op(
    "checkpoint", "elementwise", 1, ref=lambda x, recompute=None: x,
    cuda={"f": "{0}", "i": "{0}", "b": "{0}"}, attrs={"recompute": None}, internal=True,
    doc="identity whose backward recomputes a region (flame.checkpoint); vjp in autograd",
)  # fmt: skip
_unary_float(
    "erf",
    lambda x: _erf(x.astype(np.float64)).astype(x.dtype),
    "erff({0})",
)


# --- backward rules ---------------------------------------------------------------------------
# rule(F, g, out, *inputs, **attrs) -> one cotangent per input; see registry.def_vjp.
_SQRT_HALF, _INV_SQRT_2PI = 0.7071067811865476, 0.3989422804014327


def _gelu_vjp(F, g, out, x, approximate="none"):
    if approximate == "tanh":
        inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        t = F.tanh(inner)
        slope = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * 0.7978845608028654 * (1 + 0.134145 * x * x)
        return (g * slope,)
    cdf = 0.5 * (1 + F.erf(x * _SQRT_HALF))
    return (g * (cdf + x * F.exp(-0.5 * x * x) * _INV_SQRT_2PI),)


def _pow_vjp(F, g, out, x, y):
    """PyTorch's rule at every base: 0 for a zero exponent (even at a zero base), and for the
    exponent out * log(x), but 0 at a zero base with exponent >= 0 (-inf below 0; NaN for a
    negative base, whose log is NaN)."""
    return (
        F.where(y == 0.0, 0.0, g * y * F.pow(x, y - 1.0)),
        g * F.where((x == 0.0) & (y >= 0.0), 0.0, out * F.log(x)),
    )


def _minmax_vjp(pick_first):
    def rule(F, g, out, x, y):
        first = pick_first(x, y)
        tie = x == y
        half = g * 0.5
        return (
            F.where(tie, half, F.where(first, g, 0.0)),
            F.where(tie, half, F.where(first, 0.0, g)),
        )

    return rule


for _name, _rule in {
    "neg": lambda F, g, out, x: (-g,),
    "copy": lambda F, g, out, x: (g,),
    "abs": lambda F, g, out, x: (g * F.sign(x),),
    "exp": lambda F, g, out, x: (g * out,),
    "log": lambda F, g, out, x: (g / x,),
    "log1p": lambda F, g, out, x: (g / (x + 1.0),),
    "expm1": lambda F, g, out, x: (g * (out + 1.0),),
    "sqrt": lambda F, g, out, x: (g * 0.5 / out,),
    "rsqrt": lambda F, g, out, x: (g * -0.5 * out / x,),
    "sin": lambda F, g, out, x: (g * F.cos(x),),
    "cos": lambda F, g, out, x: (-g * F.sin(x),),
    "tanh": lambda F, g, out, x: (g * (1.0 - out * out),),
    "sigmoid": lambda F, g, out, x: (g * out * (1.0 - out),),
    "silu": lambda F, g, out, x: (g * F.sigmoid(x) * (1.0 + x * (1.0 - F.sigmoid(x))),),
    "reciprocal": lambda F, g, out, x: (-g * out * out,),
    "erf": lambda F, g, out, x: (g * 1.1283791670955126 * F.exp(-x * x),),
    "gelu": _gelu_vjp,
    "softplus": lambda F, g, out, x, beta=1.0, threshold=20.0: (
        g * F.where(x * beta > threshold, 1.0, F.sigmoid(x * beta)),
    ),
    "leaky_relu": lambda F, g, out, x, negative_slope=0.01: (
        F.where(x > 0, g, g * negative_slope),  # the slope a weak scalar: g's precision
    ),
    "relu": lambda F, g, out, x: (F.where(x > 0, g, 0.0),),
    "floor": lambda F, g, out, x: (g * 0.0,),
    "ceil": lambda F, g, out, x: (g * 0.0,),
    "round": lambda F, g, out, x: (g * 0.0,),
    "sign": lambda F, g, out, x: (g * 0.0,),
    "add": lambda F, g, out, x, y: (g, g),
    "sub": lambda F, g, out, x, y: (g, -g),
    "mul": lambda F, g, out, x, y: (g * y, g * x),
    "div": lambda F, g, out, x, y: (g / y, -g * out / y),
    "remainder": lambda F, g, out, x, y: (g, -g * F.floordiv(x, y)),
    "pow": _pow_vjp,
    "maximum": _minmax_vjp(lambda x, y: x > y),
    "minimum": _minmax_vjp(lambda x, y: x < y),
    "where": lambda F, g, out, condition, a, b: (
        None,
        F.where(condition, g, 0.0),
        F.where(condition, 0.0, g),
    ),
    # through a cast to an integer or bool nothing flows back (as in PyTorch)
    "cast": lambda F, g, out, x, dtype=None: (
        (g.to(x.dtype),) if x.dtype.is_float and out.dtype.is_float else (None,)
    ),
    "barrier": lambda F, g, out, x, after, token=None: (g, None),
}.items():
    def_vjp(_name, _rule)


from flame.ir.ops import elementwise_math  # noqa: E402, F401  (more ops: registers them)
