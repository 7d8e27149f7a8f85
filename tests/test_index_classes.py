"""Index classes (issue 21, "Bad input"): sizes that overflow 32-bit indexing switch to 64-bit
indexing instead of giving wrong results.

Every generated kernel computes its offsets and loop counters in one index type, ``int`` or
``long long``: a size class (``KernelSpec.index_type``, named in ``size_class``). The fixed
indexing kernels (gather, scatter) pick ``offset_t`` the same way at launch. For each
memory-bound pattern, graphs are built at sizes on both sides of the class boundary and
just below and above 2**31 elements, without allocating anything: the inputs are stand-ins
with a type and a layout but no memory (``PlannedInput``, what a cached plan keeps), and the
graphs are only lowered, never run. The class must be the one an independent bound asks for
(``needed_index``), the rendered source must declare it, and both classes must compile with
NVRTC. Views whose largest offset crosses 2**31 while their element count stays small are
classified by the offset. The gpu tier runs a few real tensors past 2**31 elements.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pytest

import flame as fl
import flame.nn.functional as F
from flame.codegen.lower import lower_group
from flame.codegen.render import render, spec_key
from flame.ir.graph import Graph
from flame.ir.node import Node
from flame.ir.passes import run_pipeline
from flame.ir.shapes import contiguous_strides, prod
from flame.runtime.executor import _layout_of
from flame.runtime.storage import PlannedInput

INT32_MAX = 2**31 - 1
INT, LONG = "int", "long long"
ROW = 1024  # the row length of the row patterns: one row class at every size below


def stand_in(shape, dtype=fl.float32, strides=None) -> fl.Tensor:
    """A CUDA-backend input of ``shape`` that holds no memory: graphs over it can be built and
    lowered (a plan's input stand-in), never run."""
    strides = tuple(strides) if strides is not None else contiguous_strides(tuple(shape))
    storage = PlannedInput("cuda", dtype, (strides, True))
    node = Node("buffer", (), (("storage", storage),), dtype, tuple(shape), None)
    return fl.Tensor(node, "cuda")


def needed_index(numel: int, reach: int, overshoot: int | None = None) -> str:
    """The index type a kernel over ``numel`` positions reading at most ``reach`` elements
    into its operands (largest offset + 1) needs: every offset it forms, and its grid-stride
    loop counter one grid past the end (at most ``numel`` rounded up to a block, unless the
    launch caps its grid at ``overshoot`` items), must fit in int32."""
    if overshoot is None:
        overshoot = -(-numel // 4096) * 4096
    return INT if max(numel + overshoot, reach) <= INT32_MAX else LONG


# --- patterns: build(n) -> (outputs, numel of the main kernel, its reach) -------------------


def _rows(n):
    return stand_in((n // ROW, ROW)), (n // ROW) * ROW


def _elementwise(n):
    x, numel = _rows(n)
    return [fl.tanh(x * 2 + stand_in((ROW,)))], numel, numel


def _elementwise_transposed(n):
    x, numel = _rows(n)
    return [x.T * 2 + 1], numel, numel  # strided reads: index math with divisions


def _broadcast(n):
    rows = n // ROW
    return [stand_in((ROW,)).expand(rows, ROW) * 2], rows * ROW, ROW


def _sum_all(n):
    x, numel = _rows(n)
    return [fl.sum(x)], numel, numel


def _sum_last(n):
    x, numel = _rows(n)
    return [fl.sum(x, -1)], numel, numel


def _sum_middle(n):
    outer = n // (8 * ROW)
    return [fl.sum(stand_in((outer, 8, ROW)), 1)], outer * 8 * ROW, outer * 8 * ROW


def _sum_columns(n):
    x, numel = _rows(n)
    return [fl.sum(x, 0)], numel, numel


def _argmax_last(n):
    x, numel = _rows(n)
    return [fl.argmax(x, -1)], numel, numel


def _argmax_all(n):
    x, numel = _rows(n)
    return [fl.argmax(x)], numel, numel


def _softmax(n):
    x, numel = _rows(n)
    return [F.softmax(x, -1)], numel, numel


def _layer_norm(n):
    x, numel = _rows(n)
    return [F.layer_norm(x, (ROW,), stand_in((ROW,)), stand_in((ROW,)))], numel, numel


def _group_norm_silu(n):
    batch = n // (64 * ROW)
    x = stand_in((batch, 64, 32, 32))
    out = F.silu(F.group_norm(x, 32, stand_in((64,)), stand_in((64,))))
    return [out], batch * 64 * ROW, batch * 64 * ROW


def _layer_norm_backward(n):
    """A row kernel that also reduces columns (dw, db as strip sums)."""
    x, numel = _rows(n)
    out, pullback = fl.vjp(
        lambda x, w, b: F.layer_norm(x, (ROW,), w, b), x, stand_in((ROW,)), stand_in((ROW,))
    )
    return [out, *pullback(stand_in(x.shape))], numel, numel


def _after_cat(n):
    """cat runs in CuPy (a library call); the kernel reading its result classifies by it."""
    x, numel = _rows(n // 2)
    return [fl.cat([x, x], 0) * 2], 2 * numel, 2 * numel


def _after_pad(n):
    x, numel = _rows(n)
    rows = x.shape[0]
    return [F.pad(x, (0, 4)) * 2], rows * (ROW + 4), rows * (ROW + 4)


PATTERNS = {
    "elementwise-broadcast": _elementwise,
    "elementwise-transposed": _elementwise_transposed,
    "broadcast-view": _broadcast,
    "sum-all": _sum_all,
    "sum-last": _sum_last,
    "sum-middle": _sum_middle,
    "sum-columns": _sum_columns,
    "argmax-last": _argmax_last,
    "argmax-all": _argmax_all,
    "softmax": _softmax,
    "layer_norm": _layer_norm,
    "group_norm-silu": _group_norm_silu,
    "layer_norm-backward": _layer_norm_backward,
    "cat-then-elementwise": _after_cat,
    "pad-then-elementwise": _after_pad,
}

# element counts: on both sides of the class boundary of a contiguous kernel (about 2**30:
# its loop counter runs one grid past the end) and just below and above 2**31
SIZES = {
    "far-below": 2**24,
    "below-boundary": 2**30 - 2**17,
    "above-boundary": 2**30 + 2**17,
    "just-below-2**31": 2**31 - 2**17,
    "just-above-2**31": 2**31 + 2**17,
}


# --- views whose largest offset crosses 2**31 while they hold few elements ------------------


def _slice_of_rows(rows: int):
    """``big[:, :64]`` of a ``[rows, 65536]`` stand-in: 64 * rows elements, the last one
    about ``rows * 2**16`` elements into the buffer."""
    return stand_in((rows, 2**16))[:, :64], rows * 64, (rows - 1) * 2**16 + 64


def _slice_elementwise(rows):
    view, numel, reach = _slice_of_rows(rows)
    return [view * 2 + 1], numel, reach


def _slice_row_sum(rows):
    view, numel, reach = _slice_of_rows(rows)
    return [fl.sum(view, -1)], numel, reach


def _slice_softmax(rows):
    view, numel, reach = _slice_of_rows(rows)
    return [F.softmax(view, -1)], numel, reach


def _slice_middle_sum(rows):
    view, numel, reach = _slice_of_rows(rows)
    return [fl.sum(view.reshape(rows, 8, 8), 1)], numel, reach


def _offset_start(rows):
    """``big[rows - 4:]``: four rows, the first of them ``(rows - 4) * 1024`` elements in."""
    view = stand_in((rows, ROW))[rows - 4 :]
    return [view * 2], 4 * ROW, rows * ROW


OFFSET_PATTERNS = {
    "slice-elementwise": _slice_elementwise,
    "slice-row-sum": _slice_row_sum,
    "slice-softmax": _slice_softmax,
    "slice-middle-sum": _slice_middle_sum,
}
# rows of 2**16 elements: the last offset just below 2**31 (minus the view's element count)
# and just above it
OFFSET_ROWS = {"offset-below-2**31": 2**15 - 64, "offset-above-2**31": 2**15 + 1}
START_ROWS = {"start-below-2**31": 2**21 - 2**12, "start-above-2**31": 2**21 + 4}


@dataclass(frozen=True)
class Kernel:
    ops: str
    spec: object
    numel: int


def lowered_kernels(outputs) -> list[Kernel]:
    graph = run_pipeline(Graph(tuple(tensor.node for tensor in outputs)))
    kernels = []
    for group in graph.groups:
        if group.kind == "library":
            continue
        lowered = lower_group(group, _layout_of)
        ops = " ".join(dict.fromkeys(node.op for node in group.nodes))
        kernels.append(Kernel(f"{group.kind}: {ops}", lowered.spec, lowered.numel))
    assert kernels, "no generated kernel in the plan"
    return kernels


def main_kernel(kernels: list[Kernel]) -> Kernel:
    """The kernel over the most positions (a split reduction's first stage, not its second)."""
    return max(kernels, key=lambda kernel: kernel.numel)


def source_index_type(source: str) -> str:
    match = re.search(r"typedef (int|long long) Index;", source)
    assert match, "the rendered kernel declares no Index type"
    return match.group(1)


def check_source(kernel: Kernel, expected: str) -> str:
    """The rendered source declares ``expected`` as its index type, every size and stride
    parameter has that type, and the size class names it."""
    spec = kernel.spec
    source = render(spec)
    assert source_index_type(source) == expected, (kernel.ops, spec.size_class)
    for arg in spec.params:
        if arg.kind in ("size", "stride"):
            assert arg.ctype == expected, (kernel.ops, arg)
            assert re.search(rf"\b{re.escape(arg.ctype)} {arg.name}\b", source), arg.name
    width = "int64" if expected == LONG else "int32"
    assert f"{width} index" in spec.size_class, (kernel.ops, spec.size_class)
    return source


def every_kernel_fits(kernels: list[Kernel]) -> None:
    """A 32-bit kernel's planned sizes, strides and offsets are int32 values (launch packs
    them as such), and its positions and loop counter stay below 2**31."""
    for kernel in kernels:
        if kernel.spec.index_type != INT:
            continue
        assert 2 * kernel.numel <= INT32_MAX, (kernel.ops, kernel.numel)
        for arg in kernel.spec.params:
            if arg.kind in ("size", "stride"):
                assert abs(arg.value) <= INT32_MAX, (kernel.ops, arg)


def _cases(patterns, sizes):
    return [
        pytest.param(pattern, size, id=f"{pattern}-{size_name}")
        for pattern in patterns
        for size_name, size in sizes.items()
    ]


ALL_CASES = (
    _cases(PATTERNS, SIZES)
    + _cases(OFFSET_PATTERNS, OFFSET_ROWS)
    + _cases({"offset-start": _offset_start}, START_ROWS)
)


@pytest.mark.parametrize("pattern, size", ALL_CASES)
def test_index_class_follows_the_largest_index(pattern, size, cuda_backend):
    build = PATTERNS.get(pattern) or OFFSET_PATTERNS.get(pattern) or _offset_start
    outputs, numel, reach = build(size)
    kernels = lowered_kernels(outputs)
    main = main_kernel(kernels)
    expected = needed_index(numel, reach)
    assert main.spec.index_type == expected, (
        f"{pattern} over {numel} elements reaching {reach}: {main.ops} chose "
        f"{main.spec.index_type!r} ({main.spec.size_class}), needs {expected!r}"
    )
    check_source(main, expected)
    every_kernel_fits(kernels)


def test_sizes_cross_the_class_boundary():
    """The table really has both classes of every contiguous pattern (the bound is not
    vacuous) and the offset views cross while their element counts stay small."""
    assert {needed_index(n, n) for n in SIZES.values()} == {INT, LONG}
    for rows in OFFSET_ROWS.values():
        assert rows * 64 < 2**22
    below, above = (needed_index(64 * r, (r - 1) * 2**16 + 64) for r in OFFSET_ROWS.values())
    assert (below, above) == (INT, LONG)
    below, above = (needed_index(4 * ROW, r * ROW) for r in START_ROWS.values())
    assert (below, above) == (INT, LONG)


def test_numel_alone_does_not_decide(cuda_backend):
    """The same element count (and the same code otherwise) in both classes: the class
    follows the view's offsets, not its size."""
    small = lowered_kernels(_slice_elementwise(OFFSET_ROWS["offset-below-2**31"])[0])
    large = lowered_kernels(_slice_elementwise(OFFSET_ROWS["offset-above-2**31"])[0])
    assert (small[0].spec.index_type, large[0].spec.index_type) == (INT, LONG)


@pytest.mark.parametrize("pattern", list(PATTERNS) + list(OFFSET_PATTERNS))
def test_both_index_classes_compile(pattern, nvrtc, cuda_backend):
    """Each distinct kernel of the pattern over the sizes of both classes compiles for sm_90."""
    from flame.runtime.compiler import nvrtc_compile

    if pattern in PATTERNS:
        built = [PATTERNS[pattern](size) for size in SIZES.values()]
    else:
        built = [OFFSET_PATTERNS[pattern](rows) for rows in OFFSET_ROWS.values()]
    specs, classes = {}, set()
    for outputs, _, _ in built:
        for kernel in lowered_kernels(outputs):
            specs.setdefault(spec_key(kernel.spec), kernel.spec)
            classes.add(kernel.spec.index_type)
    assert classes == {INT, LONG}, f"{pattern}: only {classes} over the sizes"
    for spec in specs.values():
        cubin = nvrtc_compile(render(spec), spec.name, "sm_90")
        assert cubin[:4] == b"\x7fELF", (pattern, spec.size_class)


# --- the fixed indexing kernels (gather, scatter): their class is chosen at launch ----------


class Placeholder:
    """What the indexing kernels' host code reads of a CuPy array (shape, strides, dtype),
    without memory: the launch is recorded, not made."""

    def __init__(self, shape, dtype, strides=None):
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self.itemsize = self.dtype.itemsize
        elements = strides if strides is not None else contiguous_strides(self.shape)
        self.strides = tuple(stride * self.itemsize for stride in elements)
        self.ndim = len(self.shape)
        self.size = prod(self.shape)


@pytest.fixture
def recorded_launches(monkeypatch):
    """Runs the indexing ops' host code over ``Placeholder`` arrays: the kernel chosen (its
    generator's key) and the launch's arguments are recorded instead of compiled and run."""
    cupy = pytest.importorskip("cupy", reason="the indexing ops' host code imports CuPy")
    from flame.runtime import indexing_kernels, library_indexing

    launches = []
    monkeypatch.setattr(cupy, "empty", lambda shape, dtype=None: Placeholder(shape, dtype))
    monkeypatch.setattr(
        cupy, "array", lambda array, order="C", copy=True: Placeholder(array.shape, array.dtype)
    )
    monkeypatch.setattr(indexing_kernels, "kernel", lambda kind, *key: (kind, *key))
    monkeypatch.setattr(
        indexing_kernels, "launch", lambda key, total, arguments: launches.append((key, arguments))
    )
    monkeypatch.setattr(library_indexing, "_reporting", lambda *args, **kwargs: [])
    return launches


def _index_select(rows, width, results):
    picks = results // width
    node = fl.index_select(stand_in((rows, width)), 0, stand_in((picks,), fl.int64)).node
    arrays = [Placeholder((rows, width), np.float32), Placeholder((picks,), np.int64)]
    return node, arrays, picks * width, rows * width


def _embedding(rows, width, results):
    picks = results // width // 2
    node = F.embedding(stand_in((2, picks), fl.int64), stand_in((rows, width))).node
    arrays = [Placeholder((2, picks), np.int64), Placeholder((rows, width), np.float32)]
    return node, arrays, 2 * picks * width, rows * width


def _gather(rows, width, results):
    """Along dim 1: ``results // rows`` picks a row (an index may be longer than the row)."""
    picks = results // rows
    node = fl.gather(stand_in((rows, width)), 1, stand_in((rows, picks), fl.int64)).node
    arrays = [Placeholder((rows, width), np.float32), Placeholder((rows, picks), np.int64)]
    return node, arrays, rows * picks, rows * width


def _scatter_add(rows, width, results):
    """Along dim 0: an index of ``results`` positions into a ``[rows, width]`` target."""
    picks = results // width
    target, index = stand_in((rows, width)), stand_in((picks, width), fl.int64)
    node = fl.scatter_add(target, 0, index, stand_in((picks, width))).node
    arrays = [
        Placeholder((rows, width), np.float32),
        Placeholder((picks, width), np.int64),
        Placeholder((picks, width), np.float32),
    ]
    return node, arrays, max(picks, rows) * width, rows * width


INDEXING = {
    "index_select": _index_select,
    "embedding": _embedding,
    "gather": _gather,
    "scatter_add": _scatter_add,
}
# the indexing kernels' grid is capped (132 SMs * 32 blocks of 256 threads on the H100):
# their loop counter overshoots by less than 2**24. (source rows, row length, results)
INDEXING_OVERSHOOT = 2**24
INDEXING_SIZES = {
    "small": (1000, 64, 2**18),
    "source-below-2**31": (2**21 - 8, 1024, 2**22),  # few results, near the source's end
    "source-above-2**31": (2**21 + 1, 1024, 2**22),
    "results-below-2**31": (4096, 1024, 2**31 - 2**25),
    "results-above-2**31": (4096, 1024, 2**31 + 2**12),
}


@pytest.mark.parametrize("op", list(INDEXING))
@pytest.mark.parametrize("size_name", list(INDEXING_SIZES))
def test_indexing_kernels_choose_the_offset_type(op, size_name, recorded_launches, cuda_backend):
    from flame.runtime.library import run_library

    node, arrays, total, reach = INDEXING[op](*INDEXING_SIZES[size_name])
    run_library(node, arrays)
    assert len(recorded_launches) == 1, recorded_launches
    key, arguments = recorded_launches[0]
    offset = key[-1]
    expected = needed_index(total, reach, overshoot=INDEXING_OVERSHOOT)
    assert offset == expected, f"{op} over {total} positions reaching {reach}: chose {offset!r}"
    scalar = np.int32 if offset == INT else np.int64
    total_argument = arguments[3]  # (source, index, out, total, ...)
    assert type(total_argument) is scalar, (op, type(total_argument))


def test_indexing_sizes_cross_the_class_boundary(cuda_backend):
    classes = {
        needed_index(*INDEXING[op](*size)[2:], overshoot=INDEXING_OVERSHOOT)
        for op in ("index_select",)
        for size in INDEXING_SIZES.values()
    }
    assert classes == {INT, LONG}


@pytest.mark.parametrize("kind", ["gather", "scatter_add"])
def test_indexing_kernels_compile_in_both_classes(kind, nvrtc):
    from flame.runtime import indexing_kernels
    from flame.runtime.compiler import nvrtc_compile

    for offset in (INT, LONG):
        if kind == "gather":
            source = indexing_kernels.gather_source("flame_gather_test", 2, 4, "int64", offset)
        else:
            source = indexing_kernels.scatter_add_source(
                "flame_scatter_test", 2, "float32", "int64", offset
            )
        assert f"typedef {offset} offset_t;" in source
        name = "flame_gather_test" if kind == "gather" else "flame_scatter_test"
        assert nvrtc_compile(source, name, "sm_90")[:4] == b"\x7fELF"


# --- gpu tier: real tensors past 2**31 elements ---------------------------------------------

BIG_ROWS = 2**21 + 8  # rows of 1024 int8: 2**31 + 8192 elements (2 GiB)
MODULUS = 127


def _pattern(rows: int) -> fl.Tensor:
    """``(i % 127)`` as int8 at flat position i: generated inside the one kernel that
    writes it (no 2**31-element int64 arange is ever stored)."""
    return (fl.arange(rows * ROW) % MODULUS).to(fl.int8).reshape(rows, ROW)


def _expected(start: int, stop: int) -> np.ndarray:
    return (np.arange(start, stop, dtype=np.int64) % MODULUS).astype(np.int8)


def _flat_window(tensor: fl.Tensor, start: int, stop: int) -> np.ndarray:
    return tensor.reshape(-1)[start:stop].numpy()


@pytest.mark.gpu
def test_gpu_elementwise_past_2_31(cuda_backend):
    x = _pattern(BIG_ROWS).realize()
    y = (x + 1).realize()  # reads and writes 2**31 + 8192 int8
    total = BIG_ROWS * ROW
    for start in (0, 2**31 - 4096, total - 4096):
        window = _flat_window(y, start, start + 4096)
        np.testing.assert_array_equal(window, _expected(start, start + 4096) + 1)


@pytest.mark.gpu
def test_gpu_row_sum_past_2_31(cuda_backend):
    x = _pattern(BIG_ROWS).realize()
    sums = fl.sum(x, -1).numpy()  # int64, one a row (every row: the whole tensor is read)
    assert sums.shape == (BIG_ROWS,)
    for row in (0, 2**31 // ROW - 1, 2**31 // ROW, BIG_ROWS - 1):
        expected = _expected(row * ROW, (row + 1) * ROW).astype(np.int64).sum()
        assert sums[row] == expected, row


@pytest.mark.gpu
def test_gpu_gather_past_2_31(cuda_backend):
    x = _pattern(BIG_ROWS).realize()
    rows = np.array([0, 2**31 // ROW - 1, 2**31 // ROW, 2**31 // ROW + 3, BIG_ROWS - 1])
    picked = fl.index_select(x, 0, fl.tensor(rows)).numpy()
    for position, row in enumerate(rows):
        expected = _expected(int(row) * ROW, (int(row) + 1) * ROW)
        np.testing.assert_array_equal(picked[position], expected)


@pytest.mark.gpu
def test_gpu_cat_past_2_31(cuda_backend):
    """cat (a CuPy copy) into 2**31 + 8192 int8, and a kernel reading its far end."""
    half = BIG_ROWS // 2
    x = _pattern(half).realize()
    joined = (fl.cat([x, x], 0) + 1).realize()
    for row in (0, half - 1, half, 2**31 // ROW, BIG_ROWS - 1):
        start = (row % half) * ROW
        window = joined[row].numpy()
        np.testing.assert_array_equal(window, _expected(start, start + ROW) + 1, err_msg=str(row))


@pytest.mark.gpu
def test_gpu_bfloat16_softmax_rows_past_2_31(cuda_backend):
    """A row kernel (two passes over each row) over 2**31 + 2**20 bfloat16 (4 GiB)."""
    rows = 2**21 + 2**10
    x = (fl.arange(rows * ROW) % 8).to(fl.bfloat16).reshape(rows, ROW).realize()
    out = F.softmax(x, -1).realize()  # the whole tensor, not only the rows read below
    last = out[-2:].to(fl.float32).numpy()
    row = (np.arange((rows - 2) * ROW, rows * ROW) % 8).astype(np.float64).reshape(2, ROW)
    expected = np.exp(row - row.max(-1, keepdims=True))
    expected /= expected.sum(-1, keepdims=True)
    np.testing.assert_allclose(last, expected, rtol=1e-2, atol=1e-4)
