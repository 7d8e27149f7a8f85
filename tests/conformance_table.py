"""The op-conformance table (issue 18): public ops with sample inputs and the PyTorch function
each must match, forward and backward, edge values included (zeros, bounds, infinities, NaN,
empty axes, ties).

A case's call is written once against a library namespace ``lib`` (``lib.fl`` is ``flame`` or
``torch``, ``lib.F`` their ``nn.functional``), so the same call runs in both. ``fn("cumsum",
dim=1)`` is ``lib.fl.cumsum(x, dim=1)``, ``nn("softmax", dim=1)`` is ``lib.F.softmax(x, dim=1)``;
a lambda covers the rest. ``cases`` makes one case per dtype, float64 and float32 unless told
otherwise (float16 in ``half_cases``). Float inputs are cast to the case's dtype, integer and
bool inputs (indices, masks) keep theirs, and ``cast=False`` keeps every input's own dtype (the
promotion cases). ``grad`` says whether the float inputs are differentiated. ``ERRORS`` holds
calls that PyTorch refuses: FLAME must refuse them too, with the same builtin error class. Plain
data: this module imports neither FLAME nor PyTorch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

NAN, INF = float("nan"), float("inf")
RNG = np.random.default_rng(18)  # drawn in import order: the same samples on every worker
BOTH = ("float64", "float32")
HALF = ("float16",)


@dataclass(frozen=True)
class Case:
    op: str
    call: Callable
    inputs: tuple
    variant: str = ""
    dtype: str = "float64"
    grad: bool = True
    cast: bool = True
    tolerance: float | None = None  # loosens the dtype's tolerance, never tightens it

    @property
    def id(self) -> str:
        return "-".join(part for part in (self.op, self.dtype, self.variant) if part)

    def arrays(self) -> list[np.ndarray]:
        """The inputs, float ones cast to the case's dtype."""
        arrays = [np.asarray(array) for array in self.inputs]
        if not self.cast:
            return arrays
        return [array.astype(self.dtype) if array.dtype.kind == "f" else array for array in arrays]


@dataclass(frozen=True)
class Function:
    """``lib.<namespace>.<name>(*tensors, *arguments, **keywords)``, printable in a test id."""

    name: str
    arguments: tuple = ()
    keywords: dict = field(default_factory=dict)
    namespace: str = "fl"

    def __call__(self, lib, *tensors):
        function = getattr(getattr(lib, self.namespace), self.name)
        return function(*tensors, *self.arguments, **self.keywords)


def fn(name, *arguments, **keywords) -> Function:
    return Function(name, arguments, keywords)


def nn(name, *arguments, **keywords) -> Function:
    return Function(name, arguments, keywords, namespace="F")


def cases(op, call, *inputs, dtypes=BOTH, **fields) -> list[Case]:
    """One case per dtype of the same call and inputs."""
    return [Case(op, call, tuple(inputs), dtype=dtype, **fields) for dtype in dtypes]


def normal(*shape) -> np.ndarray:
    return RNG.standard_normal(shape)


def uniform(low, high, *shape) -> np.ndarray:
    return RNG.uniform(low, high, shape)


def positive(*shape) -> np.ndarray:
    return RNG.uniform(0.5, 2.0, shape)


def mask(*shape) -> np.ndarray:
    return RNG.random(shape) < 0.5


def setitem(tensor, index, value):
    """``tensor[index] = value`` as an expression, returning the written tensor."""
    tensor[index] = value
    return tensor


def iadd(tensor, other):
    tensor += other
    return tensor


def view_write(tensor):
    """Writing through a view writes into its base, as in PyTorch."""
    tensor[0].mul_(10.0)
    return tensor


# Values where elementwise math has edges: zero of both signs, infinities, NaN, the unit bounds.
EDGES = np.array([0.0, -0.0, 1.0, -1.0, 0.5, -2.5, 3.0, INF, -INF, NAN])
SHUFFLED_EDGES = EDGES[[9, 3, 0, 8, 2, 7, 1, 6, 5, 4]]
# Inputs away from the points where a gradient is undefined, one set per domain.
SMOOTH = np.array([-2.0, -0.75, -0.1, 0.2, 0.9, 1.7, 2.5])
UNIT = np.array([-0.9, -0.5, -0.1, 0.0, 0.3, 0.7, 0.95])
ABOVE_ONE = np.array([1.1, 1.5, 2.0, 3.5, 10.0])
BASES = np.array([0.0, -2.0, 2.0, 0.0, -1.0, 1.5, -0.5, 3.0])
EXPONENTS = np.array([0.0, 2.0, 3.0, 2.0, -1.0, 0.5, 2.0, -2.0])
LEFT = np.array([-3.5, -2.0, -1.0, 0.0, 1.0, 2.5, 7.0, -7.0, 5.5])
RIGHT = np.array([2.0, -1.5, 3.0, 2.0, -2.0, 1.0, 3.0, -3.0, -2.0])
INT_LEFT = np.array([-7, -3, -1, 0, 1, 5, 7, 9], np.int64)
INT_RIGHT = np.array([2, -2, 3, 4, -3, 2, -4, 5], np.int64)
CLAMP_X = np.array([1.0, 0.0, 3.0, NAN, -1.0, 4.0, 2.0])
EMPTY = np.zeros((3, 0))
TIES = np.array([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, -1.0, 2.0], [0.0, 0.0, 0.0, 0.0]])
WITH_NAN = np.array([[1.0, NAN, 3.0], [2.0, 0.0, -1.0], [-INF, -INF, -INF]])
KINKS = np.array([-6.0, -3.0, -1.0, 0.0, 1.0, 3.0, 6.0])  # where activations change rule
ACTIVATION_INPUT = np.array([-4.0, -3.0, -1.5, -0.3, 0.4, 1.0, 2.2, 3.0, 6.5, 8.0])

UNARY = {  # name: the inputs of its gradient case (its edge case takes EDGES, forward only)
    "abs": SMOOTH, "neg": SMOOTH, "exp": SMOOTH, "exp2": SMOOTH, "expm1": SMOOTH,
    "log": ABOVE_ONE, "log2": ABOVE_ONE, "log10": ABOVE_ONE, "log1p": UNIT,
    "sqrt": ABOVE_ONE, "rsqrt": ABOVE_ONE, "reciprocal": SMOOTH,
    "sin": SMOOTH, "cos": SMOOTH, "tan": UNIT, "asin": UNIT, "acos": UNIT, "atan": SMOOTH,
    "sinh": SMOOTH, "cosh": SMOOTH, "tanh": SMOOTH, "asinh": SMOOTH, "acosh": ABOVE_ONE,
    "atanh": UNIT, "sigmoid": SMOOTH, "erf": SMOOTH, "erfinv": UNIT,
    "trunc": SMOOTH, "floor": SMOOTH, "ceil": SMOOTH, "round": SMOOTH, "sign": SMOOTH,
}  # fmt: skip

BINARY = ("add", "sub", "mul", "div", "maximum", "minimum", "atan2", "logaddexp")
SIGNED = ("fmod", "remainder", "copysign")
NAN_BINARY = ("maximum", "minimum", "add", "mul", "atan2", "logaddexp", "copysign", "fmod")
COMPARISONS = ("eq", "ne", "lt", "le", "gt", "ge")
REDUCTIONS = ("sum", "mean", "prod", "amax", "amin", "logsumexp", "var", "std")
ACTIVATIONS = (
    "relu", "relu6", "elu", "celu", "selu", "silu", "mish", "softplus", "softsign", "logsigmoid",
    "hardswish", "hardsigmoid", "hardtanh", "gelu", "sigmoid", "tanh",
)  # fmt: skip


def elementwise_cases() -> list[Case]:
    found = []
    for name, smooth in UNARY.items():
        found += cases(name, fn(name), EDGES, dtypes=BOTH, variant="edges", grad=False)
        found += cases(name, fn(name), smooth, variant="smooth")
    for name in BINARY:
        found += cases(name, fn(name), normal(3, 4), normal(4), dtypes=BOTH)
    for name in SIGNED:
        found += cases(name, fn(name), LEFT, RIGHT, variant="negative", grad=name != "remainder")
        found += cases(name, fn(name), LEFT, RIGHT, variant="negative-grad")
        found += cases(name, fn(name, -2.5), LEFT, variant="scalar")
    for name in NAN_BINARY:
        found += cases(
            name, fn(name), EDGES, SHUFFLED_EDGES, dtypes=BOTH, variant="edges", grad=False
        )
    for name in COMPARISONS:
        found += cases(name, fn(name), LEFT, RIGHT.clip(-1, 1).round(), grad=False)
    for exponent in (0.0, 1.0, 2.0, 3.0, -1.0, -2.0, 0.5):
        found += cases("pow", lambda lib, x, e=exponent: x**e, BASES, variant=f"scalar{exponent:g}")
    return found + [
        *cases("Tensor.exp", lambda lib, x: x.exp(), SMOOTH),
        *cases("Tensor.sqrt", lambda lib, x: x.sqrt(), ABOVE_ONE),
        *cases("isnan", fn("isnan"), EDGES, grad=False),
        *cases("isinf", fn("isinf"), EDGES, grad=False),
        *cases("isfinite", fn("isfinite"), EDGES, grad=False),
        *cases("nan_to_num", fn("nan_to_num"), EDGES, variant="default"),
        *cases(
            "nan_to_num",
            fn("nan_to_num", nan=0.5, posinf=9.0, neginf=-9.0),
            EDGES,
            variant="values",
        ),
        *cases("pow", fn("pow"), BASES, EXPONENTS, variant="tensor"),
        *cases("rpow", lambda lib, x: 2.0**x, SMOOTH),
        *cases("div", fn("div", rounding_mode="floor"), LEFT, RIGHT, variant="floor", grad=False),
        *cases("div", fn("div", rounding_mode="trunc"), LEFT, RIGHT, variant="trunc", grad=False),
        *cases("div", fn("div"), LEFT, np.zeros(9), variant="by-zero", grad=False),
        *cases("lerp", fn("lerp"), normal(5), normal(5), uniform(0, 1, 5)),
        *cases("addcmul", fn("addcmul", value=0.5), normal(4), normal(4), normal(4)),
        *cases("addcdiv", fn("addcdiv", value=2.0), normal(4), normal(4), positive(4)),
        *cases("where", fn("where"), mask(3, 4), normal(3, 4), normal(4)),
        *cases("where", fn("where", 0.0), mask(5), normal(5), variant="scalar"),
        # the unselected branch's NaN gradient (0 * inf) reaches the input, as in PyTorch
        *cases(
            "where", lambda lib, x: lib.fl.where(x > 0, x.sqrt(), 0.0), SMOOTH, variant="nan-branch"
        ),
        *cases("clamp", fn("clamp", 0.0, 3.0), CLAMP_X, variant="bounds"),
        *cases("clamp", fn("clamp", min=0.0), CLAMP_X, variant="min"),
        *cases("clamp", lambda lib, x: x.clamp(max=3.0), CLAMP_X, variant="max"),
        *cases("clip", fn("clip", 0.0, 3.0), CLAMP_X),
        *cases(
            "clamp",
            fn("clamp"),
            CLAMP_X,
            np.array([0.0] * 6 + [3.0]),
            np.full(7, 3.0),
            variant="tensor-bounds",
        ),
        *cases("max", fn("max"), normal(3, 4), normal(4), variant="binary"),
        *cases("isclose", fn("isclose"), EDGES, SHUFFLED_EDGES, grad=False),
        *cases(
            "isclose", fn("isclose", equal_nan=True), EDGES, EDGES, variant="equal-nan", grad=False
        ),
        *cases("logical_not", fn("logical_not"), mask(5), grad=False),
        *cases("bitwise_not", fn("bitwise_not"), INT_LEFT, dtypes=("int64",), grad=False),
        *cases("clamp_min", fn("clamp_min", 0.5), SMOOTH),
        *cases("clamp_max", fn("clamp_max", 0.5), SMOOTH),
    ]


INTEGER_OPS = {
    "floor_divide": lambda lib, x, y: x // y,
    "remainder": fn("remainder"),
    "fmod": fn("fmod"),
    "mul": lambda lib, x, y: x * y,
    "true_divide": lambda lib, x, y: x / y,
    "pow": lambda lib, x, y: x ** y.abs(),
    "abs": lambda lib, x, y: lib.fl.abs(x),
    "bitwise_and": lambda lib, x, y: x & y,
    "bitwise_xor": lambda lib, x, y: x ^ y,
    "left_shift": lambda lib, x, y: x << y.abs(),
    "right_shift": lambda lib, x, y: x >> y.abs(),
    "maximum": fn("maximum"),
}


def half_cases() -> list[Case]:
    """float16, where FLAME and PyTorch may round differently by an ulp or two."""
    found = []
    for name, smooth in UNARY.items():
        found += cases(name, fn(name), smooth, dtypes=HALF, variant="smooth")
    for name in BINARY:
        found += cases(name, fn(name), normal(3, 4), normal(4), dtypes=HALF)
    for name in ("sum", "mean", "amax", "logsumexp", "var"):
        found += cases(name, fn(name, dim=1), normal(3, 4), dtypes=HALF, variant="dim1")
    return found + [
        *cases("softmax", nn("softmax", dim=1), normal(4, 5), dtypes=HALF),
        *cases("log_softmax", nn("log_softmax", dim=1), normal(4, 5), dtypes=HALF),
        *cases("layer_norm", nn("layer_norm", (5,)), normal(4, 5), dtypes=HALF),
        *cases("matmul", fn("matmul"), normal(3, 4), normal(4, 2), dtypes=HALF),
        *cases(
            "cross_entropy", nn("cross_entropy"), normal(4, 5), np.array([1, 0, 4, 2]), dtypes=HALF
        ),
        *cases("cumsum", fn("cumsum", 1), normal(3, 4), dtypes=HALF),
        *cases(
            "to",
            lambda lib, x: x.to(lib.fl.float16),
            np.array([1e5, -7e4, 1e-8, NAN]),
            variant="overflow",
            grad=False,
        ),
    ]


def integer_cases() -> list[Case]:
    """Integer arithmetic with PyTorch's signs, and the dtypes of integer reductions."""
    found = []
    for name, call in INTEGER_OPS.items():
        found += cases(name, call, INT_LEFT, INT_RIGHT, dtypes=("int64",), grad=False)
    int32 = INT_LEFT.astype(np.int32)
    return found + [
        *cases("sum", fn("sum", dim=0), int32, dtypes=("int32",), grad=False),
        *cases("sum", lambda lib, m: m.sum(), mask(3, 4), dtypes=("bool",), grad=False),
        *cases("cumsum", fn("cumsum", 0), int32, dtypes=("int32",), grad=False),
        *cases("prod", fn("prod"), INT_RIGHT, dtypes=("int64",), grad=False),
        *cases(
            "where",
            fn("where", 0.5),
            mask(8),
            INT_LEFT,
            dtypes=("int64",),
            variant="promote",
            grad=False,
        ),
    ]


def reduction_cases() -> list[Case]:
    found = []
    for name in REDUCTIONS:
        full = fn(name, dim=(0, 1)) if name in ("amax", "amin", "logsumexp") else fn(name)
        found += cases(name, full, normal(3, 4), dtypes=BOTH, variant="all")
        found += cases(name, fn(name, dim=1, keepdim=True), normal(3, 4), variant="dim1-keepdim")
        found += cases(name, fn(name, dim=-1), np.array(1.5), variant="0d")
    for name in ("sum", "mean", "prod", "logsumexp", "var", "std", "amax"):
        empty = np.zeros((0, 3)) if name == "amax" else EMPTY  # PyTorch's amax has no identity
        found += cases(name, fn(name, dim=1), empty, variant="empty-axis")
    for name in ("amax", "sum", "logsumexp", "mean", "argmax", "argmin", "max", "sort", "cummax"):
        found += cases(name, fn(name, dim=1), WITH_NAN, variant="nan-inf", grad=False)
    for name in ("max", "min"):
        found += cases(name, fn(name, dim=1), TIES, variant="dim-ties")
        found += cases(name, fn(name, dim=1, keepdim=True), normal(3, 4), variant="keepdim")
        found += cases(name, fn(name, dim=1), normal(3, 4), variant="dim")
        found += cases(name, fn(name), normal(3, 4), variant="all")
    for name in ("argmax", "argmin"):
        found += cases(name, fn(name, dim=1), TIES, variant="ties", grad=False)
        found += cases(name, fn(name), TIES, variant="flat", grad=False)
    for name in ("any", "all"):
        found += cases(name, fn(name, dim=1), mask(3, 4), grad=False)
        found += cases(name, fn(name), mask(3, 4), variant="all", grad=False)
        found += cases(
            name, fn(name, dim=1), np.zeros((2, 0), bool), variant="empty-axis", grad=False
        )
    return found + [
        *cases("sum", fn("sum", axis=0), normal(3, 4), variant="axis"),
        *cases("sum", fn("sum", dim=[0, 2]), normal(2, 3, 4), variant="dim-list"),
        *cases("sum", fn("sum", dim=(0, 1)), np.zeros((0, 0)), variant="all-empty"),
        *cases("mean", lambda lib, x: x.mean(axis=(0, 1)), normal(3, 4), variant="axis-tuple"),
        *cases("var", fn("var", dim=1, correction=0), normal(3, 4), variant="correction0"),
        *cases(
            "var",
            fn("var", dim=1, correction=5),
            normal(3, 4),
            variant="correction-above-n",
            grad=False,
        ),
        *cases("std", fn("std", dim=0, unbiased=False), normal(3, 4), variant="biased"),
        *cases("var", fn("var", 1, unbiased=False), normal(3, 4), variant="biased"),
        *cases("topk", fn("topk", 2, dim=1), WITH_NAN, variant="nan-inf", grad=False),
        *cases(
            "logsumexp",
            fn("logsumexp", dim=1),
            np.array([[0.0, -INF], [1.0, 2.0]]),
            variant="neg-inf",
        ),
        *cases("prod", fn("prod", dim=1), TIES, variant="zeros"),
        *cases("prod", fn("prod"), TIES[:2], variant="zeros-all"),
        *cases("amax", fn("amax", dim=1), TIES, variant="ties"),
        *cases("argmax", fn("argmax", dim=0, keepdim=True), TIES, variant="keepdim", grad=False),
        *cases("argmax", fn("argmax", dim=0), np.array(2.0), variant="0d", grad=False),
        *cases("any", fn("any", dim=-1), np.array(True), variant="0d", grad=False),
        *cases("softmax", nn("softmax", dim=1), np.zeros((2, 0)), variant="empty-axis"),
        *cases("log_softmax", nn("log_softmax", dim=1), np.zeros((2, 0)), variant="empty-axis"),
        *cases("norm", fn("norm"), normal(3, 4), variant="fro"),
        *cases("norm", fn("norm", p=1, dim=1), normal(3, 4), variant="p1"),
        *cases("norm", fn("norm", dim=0, keepdim=True), normal(3, 4), variant="dim0"),
        *cases("norm", fn("norm", p=INF, dim=1), normal(3, 4), variant="inf"),
    ]


def scan_sort_cases() -> list[Case]:
    found = []
    for name in ("cumsum", "cumprod", "logcumsumexp"):
        found += cases(name, fn(name, dim=1), normal(3, 4), dtypes=BOTH, variant="dim1")
        found += cases(name, fn(name, 0), normal(3, 4), variant="dim0")
    for name in ("cummax", "cummin"):
        found += cases(name, fn(name, dim=1), normal(3, 4), variant="dim1")
        found += cases(name, fn(name, dim=1), TIES, variant="ties")
    return found + [
        # which of tied elements topk picks is unspecified in PyTorch: values only
        *cases(
            "topk", lambda lib, x: lib.fl.topk(x, 2, dim=1).values, TIES, variant="ties", grad=False
        ),
        *cases("cumprod", fn("cumprod", dim=1), TIES, variant="zeros"),
        *cases("cumsum", lambda lib, x: x.cumsum(dim=-1), np.zeros((2, 0)), variant="empty"),
        *cases("cumsum", fn("cumsum", 0), np.array(1.5), variant="0d"),
        *cases("cumprod", fn("cumprod", -1), normal(2, 3), variant="negative-dim"),
        *cases("sort", fn("sort", dim=1), normal(3, 5), variant="dim1"),
        *cases("sort", fn("sort", dim=0, descending=True), normal(3, 5), variant="descending"),
        *cases("sort", fn("sort", dim=1, stable=True), TIES, variant="ties-stable"),
        *cases("argsort", fn("argsort", dim=1, stable=True), TIES, variant="ties", grad=False),
        *cases(
            "argsort", lambda lib, x: x.argsort(dim=0, descending=True), normal(3, 5), grad=False
        ),
        *cases("topk", fn("topk", 2, dim=1), normal(3, 5), variant="k2"),
        *cases("topk", fn("topk", 2, dim=0, largest=False), normal(3, 5), variant="smallest"),
        *cases("topk", fn("topk", 1, dim=1), np.array([[1.0, 3.0, 0.0]]), variant="k1"),
        *cases("msort", fn("msort"), normal(4, 3)),
    ]


def shape_cases() -> list[Case]:
    x = normal(2, 3, 4)
    found = []
    for name in ("tril", "triu"):
        found += cases(name, fn(name), normal(4, 5))
        found += cases(name, fn(name, diagonal=-1), normal(4, 5), variant="offset")
        found += cases(name, fn(name), mask(3, 3), variant="bool", grad=False)
    for mode in ("constant", "reflect", "replicate", "circular"):
        found += cases("pad", nn("pad", (1, 2), mode=mode), x, variant=f"{mode}-1d")
        found += cases(
            "pad", nn("pad", (1, 1, 2, 0), mode=mode), normal(1, 2, 3, 4), variant=f"{mode}-2d"
        )
    return found + [
        *cases(
            "pad", nn("pad", (2, -1), value=1.5), normal(3, 4), variant="constant-value-negative"
        ),
        *cases("reshape", fn("reshape", (4, -1)), x),
        *cases("view", lambda lib, x: x.view(6, 4), x),
        *cases("permute", lambda lib, x: x.permute(2, 0, 1), x),
        *cases("transpose", fn("transpose", 0, 2), x),
        *cases("mT", lambda lib, x: x.mT, x),
        *cases("squeeze", fn("squeeze", 1), normal(3, 1, 2), variant="dim"),
        *cases("squeeze", lambda lib, x: x.squeeze(), normal(1, 3, 1), variant="all"),
        *cases("unsqueeze", fn("unsqueeze", -1), x),
        *cases("flatten", fn("flatten", 1), x),
        *cases("flatten", fn("flatten"), np.array(2.5), variant="0d"),
        *cases("squeeze", lambda lib, x: x.squeeze(), np.array(2.5), variant="0d"),
        *cases(
            "meshgrid", lambda lib, x, y: lib.fl.meshgrid(x, y, indexing="ij"), normal(3), normal(2)
        ),
        *cases("unflatten", fn("unflatten", 2, (2, 2)), x),
        *cases("chunk", fn("chunk", 3, dim=2), x, variant="uneven"),
        *cases("split", fn("split", 3, dim=2), x, variant="size"),
        *cases("split", fn("split", [1, 3], dim=2), x, variant="sizes"),
        *cases("unbind", fn("unbind", 1), x),
        *cases("movedim", fn("movedim", 0, -1), x),
        *cases("roll", fn("roll", 2, 2), x, variant="dim"),
        *cases("roll", fn("roll", (1, -1), (0, 1)), x, variant="dims"),
        *cases("roll", fn("roll", 5), x, variant="flat"),
        *cases("flip", fn("flip", (0, 2)), x),
        *cases("flip", fn("flip", (-1,)), x, variant="negative-dim"),
        *cases("permute", fn("permute", (-1, 0, 1)), x, variant="negative-dims"),
        *cases("transpose", lambda lib, x: x.transpose(-1, -2), x, variant="negative-dims"),
        *cases("repeat", lambda lib, x: x.repeat(2, 1, 2), x),
        *cases("repeat_interleave", fn("repeat_interleave", 2, dim=1), x),
        *cases("repeat_interleave", fn("repeat_interleave", 3), normal(2, 2), variant="flat"),
        *cases("expand", lambda lib, x: x.expand(3, 4), normal(1, 4)),
        *cases("broadcast_to", fn("broadcast_to", (2, 3, 4)), normal(3, 1)),
        *cases("diag", fn("diag"), normal(4), variant="vector"),
        *cases("diag", fn("diag", 1), normal(3, 4), variant="matrix"),
        *cases("diagonal", fn("diagonal", offset=1, dim1=0, dim2=2), x),
        *cases("cat", lambda lib, x, y: lib.fl.cat([x, y], dim=1), normal(2, 3), normal(2, 1)),
        *cases(
            "cat",
            lambda lib, x, y: lib.fl.cat([x, y]),
            normal(2, 3),
            np.zeros((0, 3)),
            variant="empty",
        ),
        *cases("stack", lambda lib, x, y: lib.fl.stack([x, y], 1), normal(2, 3), normal(2, 3)),
        *cases("narrow", fn("narrow", 2, 1, 2), x),
        *cases("unfold", lambda lib, x: x.unfold(1, 2, 1), normal(2, 5)),
        *cases("outer", fn("outer"), normal(3), normal(4)),
    ]


GETITEM = {
    "int": lambda lib, x: x[1],
    "negative-int": lambda lib, x: x[-1, 2],
    "slice": lambda lib, x: x[:, 1:3],
    "step": lambda lib, x: x[..., ::2],
    "none-ellipsis": lambda lib, x: x[None, ..., 0],
    "list": lambda lib, x: x[:, [2, 0, 2]],
    "two-lists": lambda lib, x: x[[0, 1, 1], :, [3, 0, 3]],
    "int-and-list": lambda lib, x: x[1, [0, 2], 1:],
    "separated": lambda lib, x: x[[0, 1], 1:, [2, 3]],
}


def indexing_cases() -> list[Case]:
    x, y = normal(3, 4), normal(2, 3, 4)
    index = np.array([[0, 2, 2], [3, 1, 0], [1, 1, 1]])
    repeated = np.array([[0, 2, 0], [3, 1, 3], [1, 1, 1]])
    found = []
    for name, call in GETITEM.items():
        found += cases("getitem", call, y, variant=name)
    for reduce in ("sum", "prod", "mean", "amax", "amin"):
        call = lambda lib, x, i, s, r=reduce: lib.fl.scatter_reduce(x, 1, i, s, r)  # noqa: E731
        found += cases(
            "scatter_reduce",
            call,
            x,
            repeated,
            normal(3, 3),
            variant=reduce,
            grad=reduce in ("sum", "prod", "mean"),
        )
    zeros_src = np.array([[0.0, 1.5, -2.0], [0.0, 0.0, 3.0], [2.0, 0.0, -1.0]])
    for include_self in (True, False):
        found += cases(
            "scatter_reduce",
            lambda lib, x, i, s, inc=include_self: lib.fl.scatter_reduce(
                x, 1, i, s, "prod", include_self=inc
            ),
            np.array([[1.0, -2.0, 0.0, 4.0], [0.5, 3.0, 1.0, -1.0], [0.0, 2.0, 2.5, 1.0]]),
            np.array([[0, 0, 2], [1, 1, 1], [3, 2, 3]]),
            zeros_src,
            variant=f"prod-zeros{'' if include_self else '-exclude-self'}",
        )
    return found + [
        *cases("getitem", lambda lib, x, i: x[i], y, np.array([[0, 1], [1, 1]]), variant="tensor"),
        *cases("getitem", lambda lib, x, m: x[m], y, mask(2, 3), variant="mask"),
        *cases("gather", lambda lib, x, i: lib.fl.gather(x, 1, i), x, index),
        *cases(
            "index_select", lambda lib, x, i: lib.fl.index_select(x, 1, i), x, np.array([3, 0, 3])
        ),
        *cases("take_along_dim", fn("take_along_dim", dim=1), x, index),
        *cases(
            "scatter",
            lambda lib, x, i, s: lib.fl.scatter(x, 1, i, s),
            x,
            np.array([[0, 2], [3, 1], [1, 0]]),
            normal(3, 2),
            variant="src",
        ),
        *cases(
            "scatter",
            lambda lib, x, i: lib.fl.scatter(x, 0, i, 2.0),
            x,
            np.array([[2, 0, 1, 1]]),
            variant="value",
        ),
        *cases(
            "scatter_add",
            lambda lib, x, i, s: lib.fl.scatter_add(x, 1, i, s),
            x,
            index,
            normal(3, 3),
            variant="repeats",
        ),
        *cases(
            "scatter_reduce",
            lambda lib, x, i, s: lib.fl.scatter_reduce(x, 1, i, s, "amax", include_self=False),
            x,
            index,
            normal(3, 3),
            variant="amax-exclude-self",
            grad=False,
        ),
        *cases("masked_fill", fn("masked_fill", -INF), x, mask(3, 4)),
        *cases(
            "masked_fill", lambda lib, x, m: x.masked_fill(m, 0.5), x, mask(4), variant="broadcast"
        ),
        *cases("masked_select", fn("masked_select"), x, mask(3, 4)),
        *cases("nonzero", fn("nonzero"), mask(3, 4), grad=False),
        *cases("embedding", nn("embedding"), index, normal(5, 2)),
    ]


CREATORS = {
    "arange": lambda lib: lib.fl.arange(5),
    "arange-float": lambda lib: lib.fl.arange(0.5, 3.0, 0.5),
    "arange-negative-step": lambda lib: lib.fl.arange(5, -3, -2),
    "linspace": lambda lib: lib.fl.linspace(-1.0, 2.0, 7),
    "linspace-one": lambda lib: lib.fl.linspace(0.0, 1.0, 1),
    "logspace": lambda lib: lib.fl.logspace(-2.0, 2.0, 5),
    "logspace-base2": lambda lib: lib.fl.logspace(0.0, 3.0, 4, base=2.0),
    "eye": lambda lib: lib.fl.eye(3),
    "eye-rect": lambda lib: lib.fl.eye(2, 4, dtype=lib.fl.int64),
    "zeros": lambda lib: lib.fl.zeros(2, 3, dtype=lib.fl.int32),
    "ones": lambda lib: lib.fl.ones((2, 0), dtype=lib.fl.float64),
    "full": lambda lib: lib.fl.full((2, 2), 7, dtype=lib.fl.int64),
    "full-float": lambda lib: lib.fl.full((3,), 1.5),
    "full-bool": lambda lib: lib.fl.full((2,), True),
    "tril_indices": lambda lib: lib.fl.tril_indices(3, 4, 1),
    "triu_indices": lambda lib: lib.fl.triu_indices(4, 3),
    "one_hot": lambda lib: lib.F.one_hot(lib.fl.arange(4) % 3, 3),
}


def creation_cases() -> list[Case]:
    return [Case(name, call, (), dtype="", grad=False) for name, call in CREATORS.items()] + [
        *cases("zeros_like", fn("zeros_like"), normal(2, 3), grad=False),
        *cases("new_full", lambda lib, x: x.new_full((2, 2), 4.0), normal(3), grad=False),
        *cases("new_zeros", lambda lib, x: x.new_zeros(3), INT_LEFT, dtypes=("int64",), grad=False),
        *cases("full_like", fn("full_like", 3.0), normal(2), grad=False),
    ]


def functional_cases() -> list[Case]:
    x = normal(4, 5) * 2
    found = []
    for name in ACTIVATIONS:
        # PyTorch's own float64 hardsigmoid backward uses 1/6 rounded to float32
        loosened = 1e-7 if name == "hardsigmoid" else None
        found += cases(name, nn(name), ACTIVATION_INPUT, tolerance=loosened)
        # the gradient at the kinks, where PyTorch picks a side
        found += cases(name, nn(name), KINKS, variant="kinks", tolerance=loosened)
    return found + [
        *cases("leaky_relu", nn("leaky_relu", 0.2), KINKS, variant="kinks"),
        *cases("abs", fn("abs"), KINKS, variant="kinks"),
        *cases("sqrt", fn("sqrt"), np.array([0.0, 1.0, 4.0]), variant="at-zero"),
        *cases("maximum", fn("maximum"), KINKS, KINKS, variant="ties"),
        *cases("minimum", fn("minimum"), KINKS, -KINKS, variant="kinks"),
        *cases("norm", fn("norm"), np.zeros(3), variant="at-zero"),
        *cases("norm", fn("norm", dim=1), np.array([[0.0, 0.0], [3.0, 4.0]]), variant="row-zero"),
        *cases("atan2", fn("atan2"), np.array([0.0, 1.0]), np.array([0.0, 0.0]), variant="origin"),
        *cases(
            "logaddexp",
            fn("logaddexp"),
            np.array([-INF, 0.0]),
            np.array([-INF, 0.0]),
            variant="ties-inf",
        ),
        *cases("leaky_relu", nn("leaky_relu", 0.2), ACTIVATION_INPUT, dtypes=BOTH),
        *cases("gelu", nn("gelu", approximate="tanh"), ACTIVATION_INPUT, variant="tanh"),
        *cases("elu", nn("elu", alpha=0.5), ACTIVATION_INPUT, variant="alpha"),
        *cases("hardtanh", nn("hardtanh", -2.0, 2.0), ACTIVATION_INPUT, variant="bounds"),
        *cases(
            "softplus", nn("softplus", beta=2.0, threshold=5.0), ACTIVATION_INPUT, variant="beta"
        ),
        *cases("relu", fn("relu"), EDGES, variant="edges", grad=False),
        *cases("softmax", nn("softmax", dim=1), x, dtypes=BOTH),
        *cases("softmax", lambda lib, x: x.softmax(0), x, variant="method"),
        *cases(
            "softmax",
            nn("softmax", dim=-1),
            np.array([[0.0, -INF, 1.0], [-INF, 2.0, -INF]]),
            variant="neg-inf",
        ),
        *cases("log_softmax", nn("log_softmax", dim=1), x),
        *cases("log_softmax", lambda lib, x: x.log_softmax(-1), x, variant="method"),
        *cases("softmin", nn("softmin", dim=1), x),
        *cases("layer_norm", nn("layer_norm", (5,)), x, variant="no-affine"),
        *cases(
            "layer_norm",
            lambda lib, x, w, b: lib.F.layer_norm(x, (5,), w, b),
            x,
            positive(5),
            normal(5),
        ),
        *cases("layer_norm", nn("layer_norm", (4, 5)), x, variant="two-axes"),
        *cases(
            "group_norm",
            lambda lib, x, w, b: lib.F.group_norm(x, 2, w, b),
            normal(2, 4, 3),
            positive(4),
            normal(4),
        ),
        *cases("rms_norm", lambda lib, x, w: lib.F.rms_norm(x, (5,), w), x, positive(5)),
        *cases("rms_norm", nn("rms_norm", (5,), eps=1e-3), x, variant="eps"),
        *cases("normalize", nn("normalize", dim=1), x),
        *cases("normalize", nn("normalize", p=1.0, dim=0), x, variant="p1"),
        *cases("normalize", nn("normalize"), np.zeros((2, 3)), variant="zeros"),
    ]


def loss_cases() -> list[Case]:
    logits, targets = normal(4, 5), np.array([1, 0, 4, 2])
    found = []
    for reduction in ("mean", "sum", "none"):
        found += cases(
            "cross_entropy",
            nn("cross_entropy", reduction=reduction),
            logits,
            targets,
            variant=reduction,
        )
        found += cases(
            "nll_loss",
            nn("nll_loss", reduction=reduction),
            normal(4, 5),
            targets,
            variant=reduction,
        )
        found += cases(
            "mse_loss",
            nn("mse_loss", reduction=reduction),
            normal(3, 4),
            normal(3, 4),
            variant=reduction,
        )
        found += cases(
            "l1_loss",
            nn("l1_loss", reduction=reduction),
            normal(3, 4),
            normal(3, 4),
            variant=reduction,
        )
    for beta in (1.0, 0.5):
        found += cases(
            "smooth_l1_loss",
            nn("smooth_l1_loss", beta=beta),
            normal(3, 4),
            normal(3, 4),
            variant=f"beta{beta:g}",
        )
        found += cases(
            "huber_loss",
            nn("huber_loss", delta=beta, reduction="sum"),
            normal(3, 4),
            normal(3, 4),
            variant=f"delta{beta:g}",
        )
    log_probabilities = np.log(RNG.dirichlet(np.ones(5), 4))
    return found + [
        *cases(
            "cross_entropy",
            nn("cross_entropy", ignore_index=0),
            logits,
            targets,
            variant="ignore-index",
        ),
        *cases(
            "cross_entropy",
            nn("cross_entropy", label_smoothing=0.1),
            logits,
            targets,
            variant="label-smoothing",
        ),
        *cases(
            "cross_entropy",
            nn("cross_entropy"),
            logits,
            RNG.dirichlet(np.ones(5), 4),
            variant="probabilities",
        ),
        *cases(
            "binary_cross_entropy",
            nn("binary_cross_entropy"),
            uniform(0.05, 0.95, 6),
            uniform(0, 1, 6),
        ),
        *cases(
            "binary_cross_entropy_with_logits",
            nn("binary_cross_entropy_with_logits"),
            normal(6) * 3,
            uniform(0, 1, 6),
        ),
        *cases(
            "binary_cross_entropy_with_logits",
            nn("binary_cross_entropy_with_logits", reduction="sum"),
            np.array([-50.0, 50.0, 0.0]),
            np.array([1.0, 0.0, 0.5]),
            variant="saturated",
        ),
        *cases(
            "kl_div",
            nn("kl_div", reduction="batchmean"),
            log_probabilities,
            RNG.dirichlet(np.ones(5), 4),
        ),
        *cases(
            "kl_div",
            nn("kl_div", reduction="sum", log_target=True),
            log_probabilities,
            log_probabilities[::-1].copy(),
            variant="log-target",
        ),
        *cases(
            "cross_entropy",
            nn("cross_entropy"),
            normal(2, 5, 3),
            np.array([[0, 4, 2], [1, 1, 3]]),
            variant="spatial",
        ),
        *cases(
            "binary_cross_entropy",
            nn("binary_cross_entropy", reduction="none"),
            uniform(0.05, 0.95, 6),
            uniform(0, 1, 6),
            variant="none",
        ),
        *cases(
            "kl_div",
            nn("kl_div", reduction="none"),
            log_probabilities,
            RNG.dirichlet(np.ones(5), 4),
            variant="none",
        ),
        *cases(
            "smooth_l1_loss",
            nn("smooth_l1_loss", reduction="none"),
            normal(3, 4),
            normal(3, 4),
            variant="none",
        ),
    ]


EINSUM = {  # equation: the shapes of its operands
    "ij,jk->ik": ((3, 4), (4, 2)),
    "bij,bjk->bik": ((2, 3, 4), (2, 4, 5)),
    "ii->i": ((3, 3),),
    "ij->": ((3, 4),),
    "i,j->ij": ((3,), (4,)),
    "bhqd,bhkd->bhqk": ((1, 2, 3, 4), (1, 2, 5, 4)),
    "...ij->...ji": ((2, 3, 4),),
}


def contraction_cases() -> list[Case]:
    found = []
    for equation, shapes in EINSUM.items():
        variant = equation.replace("->", "-to-").replace("...", "ellipsis")
        found += cases(
            "einsum",
            lambda lib, *xs, e=equation: lib.fl.einsum(e, *xs),
            *(normal(*shape) for shape in shapes),
            variant=variant,
        )
    return found + [
        *cases("matmul", fn("matmul"), normal(3, 4), normal(4, 2), dtypes=BOTH),
        *cases("matmul", lambda lib, x, y: x @ y, normal(2, 3, 4), normal(4, 2), variant="batched"),
        *cases("matmul", lambda lib, x, y: x @ y, normal(4), normal(4, 3), variant="vector"),
        *cases("matmul", lambda lib, x, y: x @ y, normal(3, 0), normal(0, 2), variant="k0"),
        *cases("bmm", fn("bmm"), normal(2, 3, 4), normal(2, 4, 5)),
    ]


PROMOTION_VALUES = {
    "float32": np.array([1.5, -2.0, 0.0], np.float32),
    "float64": np.array([0.25, 3.0, -1.0], np.float64),
    "int64": np.array([2, -3, 0], np.int64),
    "int32": np.array([-1, 4, 5], np.int32),
    "bool": np.array([True, False, True]),
}
PROMOTION_CALLS = {  # operation: (call, the dtype of its second operand, or None for a scalar)
    "add": (lambda lib, x, y: x + y, "each"),
    "mul-int": (lambda lib, x: x * 2, None),
    "mul-float": (lambda lib, x: x * 2.5, None),
    "div": (lambda lib, x, y: x / y, "int32"),
}


def promotion_cases() -> list[Case]:
    """Binary ops across float32/float64/int64/int32/bool and Python scalars: result dtypes."""
    found = []
    for operation, (call, second) in PROMOTION_CALLS.items():
        for left, values in PROMOTION_VALUES.items():
            rights = PROMOTION_VALUES if second == "each" else [second] if second else [None]
            for right in rights:
                inputs = (values,) if right is None else (values, PROMOTION_VALUES[right])
                dtype = left if second != "each" else f"{left}+{right}"
                found.append(
                    Case(f"promote-{operation}", call, inputs, dtype=dtype, grad=False, cast=False)
                )
    return found


INPLACE = {
    "add_": lambda lib, x, y: x.clone().add_(y, alpha=2.0),
    "sub_": lambda lib, x, y: x.clone().sub_(y),
    "mul_": lambda lib, x, y: x.clone().mul_(y),
    "div_": lambda lib, x, y: x.clone().div_(y),
    "lerp_": lambda lib, x, y: x.clone().lerp_(y, 0.1),
    "clamp_": lambda lib, x, y: x.clone().clamp_(-0.5, 0.5),
    "addcmul_": lambda lib, x, y: x.clone().addcmul_(y, y, value=0.5),
    "addcdiv_": lambda lib, x, y: x.clone().addcdiv_(y, y.abs() + 1.0, value=0.5),
    "masked_fill_": lambda lib, x, y: x.clone().masked_fill_(y > 0, 0.0),
    "zero_": lambda lib, x, y: x.clone().zero_(),
    "fill_": lambda lib, x, y: x.clone().fill_(2.5),
    "copy_": lambda lib, x, y: x.clone().copy_(y),
    "iadd": lambda lib, x, y: iadd(x.clone(), y),
    "setitem-int": lambda lib, x, y: setitem(x.clone(), 1, 5.0),
    "setitem-slice": lambda lib, x, y: setitem(x.clone(), (slice(None), 0), y[:, 1]),
    "setitem-mask": lambda lib, x, y: setitem(x.clone(), y > 0, -1.0),
    "setitem-view": lambda lib, x, y: view_write(x.clone()),
    "add_-broadcast": lambda lib, x, y: x.clone().add_(y[0]),
    "mul_-scalar": lambda lib, x, y: x.clone().mul_(-3.0),
    "clamp_-min": lambda lib, x, y: x.clone().clamp_(min=0.0),
    "masked_fill_-broadcast": lambda lib, x, y: x.clone().masked_fill_(y[0] > 0, -INF),
    "setitem-list": lambda lib, x, y: setitem(x.clone(), ([0, 2], [1, 3]), 7.0),
    "setitem-ellipsis": lambda lib, x, y: setitem(x.clone(), (..., -1), y[:, 0]),
}


NARROW_INTS = np.array([-300, -129, -1, 0, 127, 128, 255, 256, 40000], np.int64)
CASTS = {  # target dtype: the inputs cast to it
    "int32": EDGES[:7], "int64": LEFT, "bool": EDGES, "float32": INT_LEFT, "float64": mask(4),
}  # fmt: skip


def cast_cases() -> list[Case]:
    """``to``/``type`` between dtypes: truncation toward zero, NaN to True, bool to 1.0."""
    found = []
    for target, values in CASTS.items():
        call = lambda lib, x, t=target: x.to(getattr(lib.fl, t))  # noqa: E731
        found += cases("to", call, values, dtypes=(target,), cast=False, grad=False)
    for target in ("int8", "uint8", "int16"):  # integer narrowing wraps around, as in C
        call = lambda lib, x, t=target: x.to(getattr(lib.fl, t))  # noqa: E731
        found += cases("to", call, NARROW_INTS, dtypes=(target,), cast=False, grad=False)
    return found + [
        *cases("to", lambda lib, x: x.to(lib.fl.float32), normal(4), variant="f64-to-f32"),
        *cases("type_as", lambda lib, x, y: x.type_as(y), INT_LEFT, normal(8), grad=False),
        *cases("double", lambda lib, x: x.double(), normal(3), dtypes=("float32",)),
        *cases("long", lambda lib, x: x.long(), LEFT, grad=False),
        *cases("type", lambda lib, x: x.type(lib.fl.int32), LEFT, grad=False),
    ]


DIFFERENTIABLE_INPLACE = {  # written into a non-leaf, so autograd follows the write
    "add_": lambda lib, x, y: (x * 1.0).add_(y, alpha=2.0),
    "mul_": lambda lib, x, y: (x * 1.0).mul_(y),
    "lerp_": lambda lib, x, y: (x * 1.0).lerp_(y, 0.25),
    "addcmul_": lambda lib, x, y: (x * 1.0).addcmul_(y, y, value=0.5),
    "masked_fill_": lambda lib, x, y: (x * 1.0).masked_fill_(y > 0, 0.0),
    "clamp_": lambda lib, x, y: (x * 1.0).clamp_(-0.5, 0.5),
    "setitem-slice": lambda lib, x, y: setitem(x * 1.0, (slice(None), 0), y[:, 1]),
    "setitem-int": lambda lib, x, y: setitem(x * 1.0, 1, 5.0),
    "setitem-mask": lambda lib, x, y: setitem(x * 1.0, y > 0, 2.0),
}


def inplace_cases() -> list[Case]:
    """In-place updates: on a clone, compared on the values they leave; on a non-leaf, also on
    the gradients that flow through the write."""
    x, y = normal(3, 4), normal(3, 4)
    found = [
        Case(name, call, (x, y), dtype="float32", grad=False) for name, call in INPLACE.items()
    ]
    for name, call in DIFFERENTIABLE_INPLACE.items():
        found += cases(name, call, x, y, variant="grad")
    return found


CASES: list[Case] = [
    *elementwise_cases(),
    *half_cases(),
    *integer_cases(),
    *reduction_cases(),
    *scan_sort_cases(),
    *shape_cases(),
    *indexing_cases(),
    *creation_cases(),
    *functional_cases(),
    *loss_cases(),
    *contraction_cases(),
    *promotion_cases(),
    *cast_cases(),
    *inplace_cases(),
]


ERRORS = {  # name: (a call PyTorch refuses, its inputs)
    "pow-int-negative": (lambda lib, x: x**-1, (INT_LEFT,)),
    "cat-shape-mismatch": (
        lambda lib, x, y: lib.fl.cat([x, y], dim=0),
        (normal(2, 3), normal(2, 2)),
    ),
    "add-shape-mismatch": (lambda lib, x, y: x + y, (normal(2, 3), normal(4))),
    "matmul-shape-mismatch": (lambda lib, x, y: x @ y, (normal(2, 3), normal(4, 2))),
    "getitem-out-of-range": (lambda lib, x: x[5], (normal(3, 2),)),
    "dim-out-of-range": (lambda lib, x: lib.fl.sum(x, dim=2), (normal(3, 2),)),
    "amax-empty-axis": (lambda lib, x: lib.fl.amax(x, dim=1), (EMPTY,)),
    "reshape-bad-size": (lambda lib, x: x.reshape(4, 2), (normal(3, 2),)),
    "gather-index-out-of-range": (
        lambda lib, x, i: lib.fl.gather(x, 1, i),
        (normal(2, 2), np.array([[0, 5], [1, 0]])),
    ),
    "nll_loss-bad-target": (
        lambda lib, x, t: lib.F.nll_loss(x, t),
        (normal(2, 3), np.array([0, 7])),
    ),
    "cross_entropy-bad-target": (
        lambda lib, x, t: lib.F.cross_entropy(x, t),
        (normal(2, 3), np.array([0, 7])),
    ),
}
