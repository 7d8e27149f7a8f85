"""Rows of any length (issue 21, scope item 3): softmax, log_softmax, logsumexp and
cross-entropy, forward and backward, over rows that do not fit the register-cache classes.

CPU tier: which size class a row gets on both sides of each boundary, and that the class's
kernel compiles with NVRTC; how many times each kernel passes over the row
(``row_traffic``: the online max + sum of ``flame/codegen/reduce_online.py`` takes the max
and the sum of exp in one read); the generated online statements run through a C compiler
on the host against float64 NumPy, edge cases included (rows of -inf, +inf, NaN, empty
partial results); the reference interpreter's values. gpu tier: the same functions on the
GPU at row lengths around every boundary (odd, prime, powers of two, 30 k - 260 k) against
float64 NumPy."""

from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest

import flame as fl
import flame.nn.functional as F
from flame.codegen.lower import lower_group
from flame.codegen.render import render
from flame.ir.graph import Graph
from flame.ir.passes import run_pipeline
from flame.runtime.executor import _layout_of

# the last register-cache length of a one-read row kernel (512 threads x 4 lanes x 16 chunks)
# and the next multiple of 4 (1024 threads: streamed)
CACHED_LAST, STREAMED_FIRST = 32768, 32772
ROWS = 64  # fewer rows of >= 65536 are split over blocks in two stages (passes/split.py)


def zeros(*shape, dtype=np.float32) -> fl.Tensor:
    return fl.from_numpy(np.zeros(shape, dtype))  # never touched: graphs are only lowered


def kernels(*outputs):
    """The generated (non-library) kernels of the outputs' plan, lowered."""
    graph = run_pipeline(Graph(tuple(tensor.node for tensor in outputs)))
    return [lower_group(g, _layout_of) for g in graph.groups if g.kind != "library"]


def row_kernels(outputs, elements):
    """The row kernels that walk all ``elements`` (not the per-row helpers)."""
    found = [k for k in kernels(*outputs) if k.spec.extras.get("mode") == "block"]
    return [k for k in found if k.numel >= elements]


def _uses(lines, name) -> bool:
    text = "\n".join(lines)
    return re.search(rf"\bx_{name}\b", text.split(f"x_{name} =", 1)[-1]) is not None


def row_traffic(lowered) -> dict:
    """Passes over the row of a row kernel: per reduction pass and for the final pass, the
    operands it loads from memory (a load nothing uses is dead code: not counted), the
    operands loaded once into a row cache, and the row outputs written. ``units``: row-sized
    transfers in all (the byte count in units of one row read)."""
    extras = lowered.spec.extras
    reads = [arg.name for arg in lowered.spec.params if arg.kind == "in"]
    passes = []
    for _, chunk, lane, *_ in extras["passes"]:
        passes.append([n for n in reads if f"raw_{n}" in "\n".join(chunk) and _uses(lane, n)])
    final_chunk, final_lane = extras["final_chunk"], extras["final_lane"]
    final = [n for n in reads if f"raw_{n}" in "\n".join(final_chunk) and _uses(final_lane, n)]
    cached = [n for n in reads if f"raw_{n}" in "\n".join(extras["cache_loads"])]
    held = [n for n in reads if f"smem_{n}" in str(extras.get("shared_fill", ""))]
    cached += held  # loaded into shared memory once; the passes read it there
    passes = [[n for n in loads if n not in held] for loads in passes]
    final = [n for n in final if n not in held]
    writes = sum(1 for line in final_lane if re.match(r"(store_\d+\.v\[k\]|out\d+\[)", line))
    units = len(cached) + sum(map(len, passes)) + len(final) + writes
    return {"passes": passes, "final": final, "cached": cached, "writes": writes, "units": units}


# --- the functions ----------------------------------------------------------------------------


def softmax_forward(x):
    return [F.softmax(x, -1)]


def log_softmax_forward(x):
    return [F.log_softmax(x, -1)]


def logsumexp_forward(x):
    return [fl.logsumexp(x, -1)]


def cross_entropy_forward(x):
    return [F.cross_entropy(x, fl.from_numpy(np.zeros(x.shape[0], np.int64)))]


def with_backward(function):
    def build(x):
        out, pullback = fl.vjp(lambda t: function(t)[0], x)
        return [out, *pullback(fl.from_numpy(np.ones(out.shape, np.float32)).to(out.dtype))]

    return build


FORWARD = {
    "softmax": softmax_forward,
    "log_softmax": log_softmax_forward,
    "logsumexp": logsumexp_forward,
    "cross_entropy": cross_entropy_forward,
}


# --- CPU tier: classes, passes, NVRTC ---------------------------------------------------------


@pytest.mark.parametrize("name", list(FORWARD))
def test_streamed_forward_reads_the_row_once_for_max_and_sum(name, cuda_backend):
    """Forward over a streamed row: the max and the sum of exp are one pass (before: two)."""
    (lowered,) = row_kernels(FORWARD[name](zeros(ROWS, STREAMED_FIRST)), ROWS * STREAMED_FIRST)
    assert lowered.spec.size_class.startswith("row streamed"), lowered.spec.size_class
    traffic = row_traffic(lowered)
    assert len(traffic["passes"]) == 1, traffic  # max and sum of exp together
    assert "online" in lowered.spec.extras and lowered.spec.extras["online"][0]
    writes_rows = name in ("softmax", "log_softmax")
    assert traffic["units"] == (3 if writes_rows else 1), traffic


def test_online_switch_off_gives_two_passes(monkeypatch, cuda_backend):
    """``reduce_online.ENABLED = False`` (the probe's --two-pass A/B) lowers the old form."""
    from flame.codegen import reduce_online

    monkeypatch.setattr(reduce_online, "ENABLED", False)
    (lowered,) = row_kernels(logsumexp_forward(zeros(ROWS, STREAMED_FIRST)), ROWS * 32772)
    assert "online" not in lowered.spec.extras and row_traffic(lowered)["units"] == 2


@pytest.mark.parametrize("name", list(FORWARD))
def test_cached_forward_keeps_two_passes(name, cuda_backend):
    """Where the row sits in registers a second pass costs no memory: the exact two-pass
    form stays (no online pair, one row read)."""
    (lowered,) = row_kernels(FORWARD[name](zeros(ROWS, CACHED_LAST)), ROWS * CACHED_LAST)
    assert lowered.spec.size_class.startswith("row cached, <= 16 chunks"), lowered.spec.size_class
    assert "online" not in lowered.spec.extras
    traffic = row_traffic(lowered)
    assert traffic["cached"] and len(traffic["passes"]) == 2, traffic


def test_softmax_forward_backward_one_pass_less(cuda_backend):
    """softmax fwd+bwd in one streamed kernel: each pass after the first reads x (and gy);
    the online pair removes one pass over x."""
    outputs = with_backward(softmax_forward)(zeros(ROWS, 65536))
    (lowered,) = row_kernels(outputs, ROWS * 65536)
    traffic = row_traffic(lowered)
    assert traffic["passes"][0] == ["in0"], traffic  # max and sum of exp: x once
    assert all("in0" in loads for loads in traffic["passes"][1:]), traffic
    two_pass = sum(1 for _, _, lane, *_ in lowered.spec.extras["passes"] if "online" in str(lane))
    assert two_pass == 1


def test_online_rule_is_the_pattern_not_softmax(cuda_backend):
    """Any ``max(v)`` then ``sum(exp(v - c(max)))`` pairs; a sum of exp over another row's
    max, or of a value that is not exp of the shifted row, does not."""
    x, y = zeros(2, 50000), zeros(2, 50000)
    peak = fl.amax(x * 3, -1, keepdim=True)
    written = fl.sum(fl.exp(x * 3 - peak * 1.0), -1)  # v = x*3, c = peak * 1
    other = fl.sum(fl.exp(y - fl.amax(x, -1, keepdim=True)), -1)  # v != the max's row
    scaled = fl.sum(fl.exp(x - fl.amax(x, -1, keepdim=True)) * 2, -1)  # not exp at the top
    for outputs, pairs in (([written], 1), ([other], 0), ([scaled], 0)):
        (lowered,) = row_kernels(outputs, 100000)
        found = sum(len(p) for p in lowered.spec.extras.get("online", ()))
        assert found == pairs, (outputs, lowered.spec.extras.get("online"))


CLASS_SIDES = [(CACHED_LAST, "row cached, <= 16 chunks"), (STREAMED_FIRST, "row streamed")]


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64], ids=lambda d: d.__name__)
@pytest.mark.parametrize("length, named", CLASS_SIDES, ids=["cached-side", "streamed-side"])
@pytest.mark.parametrize("name", list(FORWARD))
def test_both_sides_of_the_streamed_boundary_compile(name, length, named, dtype, nvrtc,
                                                     cuda_backend):  # fmt: skip
    """Forward and backward kernels on each side of the register-cache / streamed boundary:
    the class is the one named, and NVRTC compiles each kernel of the plan for sm_90."""
    from flame.runtime.compiler import nvrtc_compile

    x = zeros(ROWS, length, dtype=dtype)
    forward = FORWARD[name](x)
    if dtype is not np.float64:  # 8-byte rows hold half as many values in registers
        classes = [k.spec.size_class for k in row_kernels(forward, ROWS * length)]
        if dtype is np.float16 and named.startswith("row cached"):
            # 16-byte vectors of a 2-byte row (8 lanes, reduce.WIDE_HALF_VECTORS): the same
            # 512 x 64 values a row in half as many chunks
            named = "row cached, <= 8 chunks"
        # past the register classes a 2-byte row fits the shared-memory row cache
        allowed = (named, "row in shared memory") if named == "row streamed" else (named,)
        assert classes and all(c.startswith(allowed) for c in classes), classes
    for lowered in kernels(*forward, *with_backward(FORWARD[name])(x)):
        cubin = nvrtc_compile(render(lowered.spec), lowered.spec.name, "sm_90")
        assert cubin[:4] == b"\x7fELF", lowered.spec.size_class


# --- CPU tier: the shared-memory row cache ---------------------------------------------------

# float16 softmax forward + backward (x and gy held, 2 bytes each); the boundaries of its classes
HALF = np.float16
SHARED_SIDES = [
    (16384, "row cached, <= 8 chunks"),  # x and gy in registers (2 reads x 4 lanes x 8 <= 96)
    (16388, "row in shared memory (2 of 2 reads)"),  # 9 chunks: no register class fits
    (28672, "row in shared memory (2 of 2 reads)"),  # 2 x 56 KiB: the budget exactly
    (28676, "row in shared memory (1 of 2 reads)"),  # x only (read by more passes)
    (57344, "row in shared memory (1 of 2 reads)"),  # x alone: 112 KiB
    (57348, "row streamed"),
]


@pytest.fixture
def shared_rows(monkeypatch):
    """The shared-memory row cache switched on for this test (its launch needs
    flame/runtime/launch.py to pass ``Lowered.shared_bytes``)."""
    from flame.codegen import reduce, reduce_shared

    monkeypatch.setattr(reduce_shared, "ENABLED", True)
    # the shared row cache's boundaries below are for 8-byte vectors of 2-byte rows (4 lanes)
    monkeypatch.setattr(reduce, "WIDE_HALF_VECTORS", False)
    return reduce_shared


@pytest.mark.parametrize("length, named", SHARED_SIDES, ids=[str(n) for n, _ in SHARED_SIDES])
def test_shared_row_class_both_sides(length, named, shared_rows, nvrtc, cuda_backend):
    """Each side of each boundary gets its class, its launch asks for the held rows' bytes,
    a held read is loaded from memory once, and NVRTC compiles the kernel."""
    from flame.runtime.compiler import nvrtc_compile

    x, gy = zeros(ROWS, length, dtype=HALF), zeros(ROWS, length, dtype=HALF)
    out, pullback = fl.vjp(lambda t: F.softmax(t, -1), x)
    (lowered,) = row_kernels([out, *pullback(gy)], ROWS * length)
    assert lowered.spec.size_class.startswith(named), lowered.spec.size_class
    traffic = row_traffic(lowered)
    held = int(named.split("(")[1][0]) if "shared" in named else 0
    row_bytes = -(-length * 2 // 16) * 16
    assert lowered.shared_bytes == held * row_bytes
    assert lowered.shared_bytes <= shared_rows.SHARED_ROW_BYTES
    if held:
        assert lowered.threads <= shared_rows.SHARED_THREADS
        assert "in0" in traffic["cached"], traffic  # x: loaded once, read by every pass
        assert all("in0" not in loads for loads in traffic["passes"]), traffic
    cubin = nvrtc_compile(render(lowered.spec), lowered.spec.name, "sm_90")
    assert cubin[:4] == b"\x7fELF"


def test_shared_rows_save_passes(shared_rows, cuda_backend):
    """With both rows held, softmax fwd+bwd moves 4 row units (x, gy once; y, dx written)."""
    x, gy = zeros(ROWS, 20000, dtype=HALF), zeros(ROWS, 20000, dtype=HALF)
    out, pullback = fl.vjp(lambda t: F.softmax(t, -1), x)
    (lowered,) = row_kernels([out, *pullback(gy)], ROWS * 20000)
    assert row_traffic(lowered)["units"] == 4, row_traffic(lowered)


def test_shared_rows_off_until_the_launch_passes_them(cuda_backend):
    """Switched off (the default while the launch passes no dynamic shared memory), the
    same row streams."""
    from flame.codegen import reduce_shared

    if reduce_shared.ENABLED:
        pytest.skip("the shared-memory row cache is switched on")
    x, gy = zeros(ROWS, 20000, dtype=HALF), zeros(ROWS, 20000, dtype=HALF)
    out, pullback = fl.vjp(lambda t: F.softmax(t, -1), x)
    (lowered,) = row_kernels([out, *pullback(gy)], ROWS * 20000)
    assert lowered.spec.size_class.startswith("row streamed") and not lowered.shared_bytes


def test_shared_row_class_is_a_sibling(shared_rows, cuda_backend):
    """A row kernel's siblings (the other classes of its code, compiled in the background for
    other sizes) include the shared-memory class where a read of its rows fits there."""
    from flame.codegen.reduce import sibling_specs

    x, gy = zeros(ROWS, 16384, dtype=HALF), zeros(ROWS, 16384, dtype=HALF)
    out, pullback = fl.vjp(lambda t: F.softmax(t, -1), x)
    graph = run_pipeline(Graph((out.node, *(t.node for t in pullback(gy)))))
    (group,) = [g for g in graph.groups if g.kind == "reduce"]
    lowered = lower_group(group, _layout_of)
    assert lowered.spec.size_class.startswith("row cached")
    classes = [spec.size_class for spec in sibling_specs(group, _layout_of, lowered)]
    assert any(name.startswith("row in shared memory (2 of 2") for name in classes), classes
    assert any(name.startswith("row streamed") for name in classes), classes


# --- CPU tier: the generated online statements, compiled for the host --------------------------

HARNESS = r"""
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>
#define __device__
#define __forceinline__ inline
static inline float __int_as_float(unsigned int bits) {
    float f; memcpy(&f, &bits, 4); return f;
}
static inline double __longlong_as_double(long long bits) {
    double d; memcpy(&d, &bits, 8); return d;
}
#define __expf expf
#define __logf logf
#define __shfl_xor_sync(mask, var, shift) partner_##var
HELPERS
struct Partial { ACC PEAK, TOTAL; };
static Partial fold(const std::vector<VALUE>& row, int first, int step) {
    INIT
    for (size_t i = first; i < row.size(); i += step) {
        const VALUE loaded = row[i];
        LANE
    }
    return {PEAK, TOTAL};
}
static Partial merge(Partial a, Partial b) {
    ACC PEAK = a.PEAK, TOTAL = a.TOTAL, partner_PEAK = b.PEAK, partner_TOTAL = b.TOTAL;
    int shift = 0; (void)shift;
    MERGE
    return {PEAK, TOTAL};
}
static double finish(Partial p) {
    ACC PEAK = p.PEAK, TOTAL = p.TOTAL;
    VALUE out0[1]; const int out0_outer = 0;
    FINISH
    return out0[0];
}
int main() {
    int rows; if (scanf("%d", &rows) != 1) return 1;
    for (int r = 0; r < rows; ++r) {
        int n, threads; if (scanf("%d %d", &n, &threads) != 2) return 1;
        std::vector<VALUE> row(n);
        for (int i = 0; i < n; ++i) {
            double v; if (scanf("%lf", &v) != 1) return 1;
            row[i] = (VALUE)v;
        }
        std::vector<Partial> parts;
        for (int t = 0; t < threads; ++t) parts.push_back(fold(row, t, threads));
        while (parts.size() > 1) {  // pairwise, as the shuffles and the warps' slots merge
            std::vector<Partial> next;
            for (size_t i = 0; i + 1 < parts.size(); i += 2)
                next.push_back(merge(parts[i], parts[i + 1]));
            if (parts.size() % 2) next.push_back(parts.back());
            parts = next;
        }
        printf("%.17g\n", finish(parts[0]));
    }
    return 0;
}
"""


def host_program(spec, directory) -> str:
    """The logsumexp kernel's online statements in a host C++ program (HARNESS)."""
    extras = spec.extras
    init, _, lane, _, finish = extras["passes"][0]
    (merge,) = extras["online"][0]
    (peak, acc), (total, _) = [
        (m.group(2), m.group(1)) for m in (re.match(r"(\w+) (acc\d+) = ", line) for line in init)
    ]
    value = "double" if acc == "double" else "float"
    body = [re.sub(r"raw_in0(\.v)?\[k\]", "loaded", line) for line in lane]
    source = HARNESS
    for key, text in {
        "HELPERS": "\n".join(spec.helpers), "INIT": "\n".join(init), "LANE": "\n".join(body),
        "MERGE": merge, "FINISH": "\n".join((*finish, *extras["final_scalars"])),
        "ACC": acc, "VALUE": value, "PEAK": peak, "TOTAL": total,
    }.items():  # fmt: skip
        source = source.replace(key, text)
    path = directory / "online.cpp"
    path.write_text(source)
    binary = directory / "online"
    compiler = shutil.which("g++") or shutil.which("clang++")
    subprocess.run([compiler, "-O1", "-o", str(binary), str(path)], check=True,
                   capture_output=True)  # fmt: skip
    return str(binary)


EDGE_ROWS = [
    (np.full(9, -np.inf), 4),  # every element -inf: log(0) = -inf
    (np.array([1.0, np.inf, 2.0]), 2),  # +inf wins
    (np.array([1.0, np.nan, 2.0, 3.0]), 3),  # NaN propagates
    (np.array([-1e30, -np.inf, -1e30]), 8),  # very negative, with empty thread partials
    (np.array([-1e4]), 32),  # one element, 31 empty partials merged with it
    (np.linspace(80.0, 100.0, 101), 7),  # exp of the values would overflow float32
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=lambda d: d.__name__)
def test_online_statements_on_the_host(dtype, tmp_path, rng, cuda_backend):
    """logsumexp's generated lane, merge and finish statements, compiled for the host: rows
    folded by several "threads" and merged pairwise give float64 NumPy's logsumexp."""
    if not (shutil.which("g++") or shutil.which("clang++")):
        pytest.skip("no host C++ compiler (g++ or clang++) to run the generated statements")
    (lowered,) = row_kernels([fl.logsumexp(zeros(2, 50000, dtype=dtype), -1)], 100000)
    binary = host_program(lowered.spec, tmp_path)
    rows = [(rng.standard_normal(n) * scale, threads)
            for n, scale, threads in ((1000, 1.0, 7), (4099, 30.0, 64), (5, 1.0, 16))]  # fmt: skip
    rows += EDGE_ROWS
    text = f"{len(rows)}\n" + "".join(
        f"{len(row)} {threads} " + " ".join(repr(float(v)) for v in row) + "\n"
        for row, threads in rows
    )  # fmt: skip
    done = subprocess.run([binary], input=text, capture_output=True, text=True, check=True)
    got = np.array([float(line) for line in done.stdout.split()])
    with np.errstate(invalid="ignore"):  # NaN and inf - inf rows
        expected = np.array([np.logaddexp.reduce(row.astype(dtype).astype(np.float64))
                             for row, _ in rows])  # fmt: skip
    tolerance = 1e-5 if dtype is np.float32 else 1e-12
    np.testing.assert_allclose(got, expected, rtol=tolerance, atol=tolerance)


# --- values: the reference interpreter (CPU tier) and the GPU ---------------------------------

# around every boundary: the last cached length, the first streamed one (and an odd length
# that is streamed with one lane), powers of two, primes, the bench's longest row
GPU_LENGTHS = (32767, 32768, 32772, 50021, 65536, 65537, 131071, 131072, 262144)
GPU_ROWS = 64  # whole rows, one block each (fewer rows of >= 65536 are split in two stages)


def _logsumexp64(x):
    peak = np.max(x, -1, keepdims=True)
    finite = np.where(np.isfinite(peak), peak, 0.0)
    return np.log(np.sum(np.exp(x - finite), -1, keepdims=True)) + finite


def expected(name, x, seed, target):
    """float64 NumPy: the output and the gradient of sum(out * seed) (or of the mean loss)."""
    lse = _logsumexp64(x)
    probabilities = np.exp(x - lse)
    if name == "softmax":
        dot = np.sum(probabilities * seed, -1, keepdims=True)
        return probabilities, probabilities * (seed - dot)
    if name == "log_softmax":
        return x - lse, seed - probabilities * np.sum(seed, -1, keepdims=True)
    if name == "logsumexp":
        return lse[:, 0], seed[:, None] * probabilities
    picked = x[np.arange(len(x)), target]
    onehot = np.zeros_like(x)
    onehot[np.arange(len(x)), target] = 1.0
    return np.mean(lse[:, 0] - picked), (probabilities - onehot) / len(x)


def _storage(values, dtype):
    if dtype == "bfloat16":
        import ml_dtypes

        return values.astype(ml_dtypes.bfloat16)
    return values.astype(dtype)


def out_dtype(dtype: str):
    return {"bfloat16": fl.bfloat16, "float64": fl.float64}.get(dtype, fl.float32)


def check_values(name, dtype, rows, length, seed=0):
    rng = np.random.default_rng(seed + length)
    x = _storage(rng.standard_normal((rows, length)) * 4.0, dtype)
    target = rng.integers(0, length, rows)
    if name != "cross_entropy":
        x[0, : length // 2] = -np.inf  # a row half masked: -inf in the online max and sum
    out_shape = {"softmax": (rows, length), "log_softmax": (rows, length)}.get(name, (rows,))
    seed_values = _storage(rng.standard_normal(out_shape), dtype)
    if name == "cross_entropy":
        function = lambda t: F.cross_entropy(t, fl.from_numpy(target))  # noqa: E731
        cotangent = fl.from_numpy(np.ones((), np.float32)).to(out_dtype(dtype))
    else:
        function = lambda t: FORWARD[name](t)[0]  # noqa: E731
        cotangent = fl.from_numpy(seed_values)
    out, pullback = fl.vjp(function, fl.from_numpy(x))
    (grad,) = pullback(cotangent)
    fl.realize(out, grad)  # one schedule: the forward + backward row kernel the bench runs
    x64 = x.astype(np.float64)
    seed64 = seed_values.astype(np.float64) if name != "cross_entropy" else None
    want_out, want_grad = expected(name, x64, seed64, target)
    loose = dtype in ("bfloat16", "float16")
    for label, got, want in (("out", out, want_out), ("grad", grad, want_grad)):
        got = np.asarray(got.to(fl.float64).numpy())
        scale = np.max(np.abs(want[np.isfinite(want)]), initial=1.0)
        atol = (1e-2 if loose else 1e-6) * scale
        np.testing.assert_allclose(got, want, rtol=2e-2 if loose else 1e-4, atol=atol,
                                   err_msg=f"{name} {dtype} {rows}x{length} {label}")  # fmt: skip


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", list(FORWARD))
def test_values_reference(name, dtype):
    """The reference interpreter (which ignores kernel classes) agrees with float64 NumPy on
    long rows, a half-masked row included: the oracle the GPU tier is held to. (bfloat16 is
    checked on the GPU only: the interpreter rounds every bf16 intermediate, and the gradient
    the composites route through the row max, a sum of ~0 over the row, then lands several
    bf16 units on the max's position; the kernels keep float intermediates.)"""
    with fl.backend("reference"):
        check_values(name, dtype, 4, 40009)


@pytest.mark.gpu
@pytest.mark.parametrize("length", GPU_LENGTHS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(FORWARD))
def test_values_gpu(name, dtype, length):
    """Forward and backward on the GPU around every class boundary against float64 NumPy."""
    with fl.backend("cuda"):
        check_values(name, dtype, GPU_ROWS, length)


SHARED_LENGTHS = (16388, 20011, 28672, 28676, 40000, 57344)


@pytest.mark.gpu
@pytest.mark.parametrize("length", SHARED_LENGTHS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(FORWARD))
def test_values_gpu_shared_rows(name, dtype, length, shared_rows):
    """The shared-memory row classes on the GPU against float64 NumPy (once the launch
    passes the kernel's dynamic shared memory)."""
    from flame.records import fields
    from flame.runtime.launch import Launch

    if "shared_bytes" not in {field.name for field in fields(Launch)}:
        pytest.skip("flame/runtime/launch.py passes no dynamic shared memory yet")
    with fl.backend("cuda"):
        check_values(name, dtype, GPU_ROWS, length)


# --- 16-byte vectors of 2-byte rows (reduce.WIDE_HALF_VECTORS, an A/B switch) -----------------


@pytest.fixture
def wide_half(monkeypatch):
    from flame.codegen import reduce

    monkeypatch.setattr(reduce, "WIDE_HALF_VECTORS", True)


WIDE_SIDES = [
    (np.float16, 65536, "8 lanes"),
    (np.float16, 32772, "4 lanes"),  # a multiple of 4, not of 8
    (np.float16, 32771, "1 lanes"),
    (np.float32, 65536, "4 lanes"),  # 16 bytes are 4 float32 lanes already
]


@pytest.mark.parametrize("dtype, length, lanes", WIDE_SIDES, ids=lambda v: str(v))
def test_wide_half_vectors(dtype, length, lanes, wide_half, nvrtc, cuda_backend):
    """Switched on, a 2-byte row takes 8 lanes where its length allows, else 4, else 1;
    float32 keeps 4; each kernel compiles."""
    from flame.runtime.compiler import nvrtc_compile

    x, gy = zeros(ROWS, length, dtype=dtype), zeros(ROWS, length, dtype=dtype)
    out, pullback = fl.vjp(lambda t: F.softmax(t, -1), x)
    (lowered,) = row_kernels([out, *pullback(gy)], ROWS * length)
    assert f", {lanes}," in lowered.spec.size_class, lowered.spec.size_class
    cubin = nvrtc_compile(render(lowered.spec), lowered.spec.name, "sm_90")
    assert cubin[:4] == b"\x7fELF"


@pytest.mark.gpu
@pytest.mark.parametrize("length", (16384, 32768, 32776, 65536, 262144))
@pytest.mark.parametrize("name", list(FORWARD))
def test_values_gpu_wide_half(name, length, wide_half):
    """bfloat16 rows in 16-byte vectors on the GPU against float64 NumPy."""
    with fl.backend("cuda"):
        check_values(name, "bfloat16", GPU_ROWS, length)
