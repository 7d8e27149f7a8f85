"""float64 in kernels: the float expressions of the op declarations, spelled for ``double``.

An op declares its float expression once, for ``float``: ``expf({0})``, ``1.0f``,
``__fdividef``, helpers taking ``float``. A float64 node must not run any of that in float,
so its expression is rewritten here, once, for every op (the declarations stay single):

* the float math functions become their double twins (``expf`` -> ``exp``, ``erff`` -> ``erf``;
  CUDA declares both), and the fast float intrinsics the accurate double functions
  (``__expf`` -> ``exp``, ``__fdividef(a, b)`` -> ``__ddiv_rn(a, b)``);
* float literals lose their suffix (``0.5f`` -> ``0.5``) and ``(float)`` casts become
  ``(double)``;
* a helper function the expression calls is emitted a second time, rewritten the same way
  (``float`` -> ``double`` throughout) under its name plus ``_f64``, and the calls renamed.

What cannot be rewritten, bit reinterpretations of a float (``__float_as_uint``) and
functions with no double twin, raises ``Float64Unsupported`` naming the op.
"""

from __future__ import annotations

import functools
import re

from flame.ir.ops import HELPERS

SUFFIX = "_f64"

# float math functions of CUDA whose double twin is the name without the trailing ``f``
_MATH = frozenset(
    """acosf acoshf asinf asinhf atan2f atanf atanhf cbrtf ceilf copysignf cosf coshf cospif
    erfcf erfcinvf erfcxf erff erfinvf exp10f exp2f expf expm1f fabsf fdimf floorf fmaf fmaxf
    fminf fmodf hypotf ldexpf lgammaf log10f log1pf log2f logbf logf nearbyintf nextafterf
    normcdff normcdfinvf powf rcbrtf remainderf rhypotf rintf roundf rsqrtf scalbnf sinf sinhf
    sinpif sqrtf tanf tanhf tgammaf truncf""".split()
)
# fast float intrinsics: the accurate double function (double has no fast variants)
_INTRINSICS = {
    "__expf": "exp", "__exp10f": "exp10", "__logf": "log", "__log2f": "log2",
    "__log10f": "log10", "__sinf": "sin", "__cosf": "cos", "__tanf": "tan", "__powf": "pow",
    "__fdividef": "__ddiv_rn", "__fdiv_rn": "__ddiv_rn", "__frcp_rn": "__drcp_rn",
    "__fsqrt_rn": "__dsqrt_rn", "__fadd_rn": "__dadd_rn", "__fmul_rn": "__dmul_rn",
    "__fsub_rn": "__dsub_rn", "__fmaf_rn": "__fma_rn",
}  # fmt: skip
# spellings that only make sense for float bits: no rewrite gives them a double meaning
_FLOAT_ONLY = re.compile(r"\b(__float_as_u?int|__float2\w+|__saturatef|__fsqrt_r[dzu])\s*\(")
_CALL = re.compile(r"\b(\w+)\s*\(")
_FLOAT_LITERAL = re.compile(
    r"(?<![\w.])((?:\d+\.\d*|\.\d+)(?:[eE][+-]?\d+)?|\d+[eE][+-]?\d+)[fF](?!\w)"
)
_FLOAT_TYPE = re.compile(r"\bfloat\b")


class Float64Unsupported(TypeError):
    """An op's float expression has no double form."""


def double_text(text: str, what: str = "expression") -> str:
    """``text`` (C code written for float) rewritten for double (see the module doc)."""
    refused = _FLOAT_ONLY.search(text)
    if refused:
        raise Float64Unsupported(
            f"{what}: cannot compute float64: it uses {refused.group(1)}, which reads float bits"
        )
    helpers = _helper_functions()

    def call(match: re.Match) -> str:
        name = match.group(1)
        if name in _INTRINSICS:
            name = _INTRINSICS[name]
        elif name in _MATH:
            name = name[:-1]
        elif name in helpers:
            name = name + SUFFIX
        return name + "("

    text = _CALL.sub(call, text)
    text = _FLOAT_LITERAL.sub(r"\1", text)
    return _FLOAT_TYPE.sub("double", text)


@functools.cache
def double_helper(name: str) -> str:
    """The source of helper ``name`` rewritten for double, its functions renamed ``*_f64``
    (the float original may sit in the same kernel)."""
    return double_text(HELPERS[name], f"helper {name}")


def _helper_functions() -> frozenset:
    """Every function some helper defines (their calls get the ``_f64`` names)."""
    return _defined_in(tuple(HELPERS))


@functools.cache
def _defined_in(names: tuple) -> frozenset:
    found = set()
    for name in names:
        found.update(re.findall(r"__device__[^(;{]*?\b(\w+)\s*\(", HELPERS[name]))
    return frozenset(found)
