"""Row kernels that also reduce columns (flame/ir/passes/row_columns.py): layer norm's forward
and backward read x and dy once; the row kernel accumulates dw and db over strips of rows in
registers. By default (float32 sums) it adds each strip's partial sums into the zeroed result
with atomicAdd: one kernel, no strips x columns buffer. With deterministic algorithms
(``fl.use_deterministic_algorithms(True)``) it writes one partial row per strip and a small
kernel sums them in a fixed order. CPU tier: the plan's shape, the planned peak and NVRTC
compiles every kernel in both modes; gpu tier: values against the float64 reference
interpreter in both modes, and bitwise-identical reruns in deterministic mode."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from plan_memory import planned_peak

import flame as fl
from flame.codegen.lower import lower_group
from flame.codegen.render import render
from flame.ir.graph import Graph
from flame.ir.ops import get_op
from flame.ir.passes import row_columns, run_pipeline, split
from flame.ir.passes.split import ROW_COLUMN_VALUES, ROW_STRIPS, _strip_target, _strips
from flame.runtime.compiler import nvrtc_compile
from flame.runtime.executor import _layout_of
from flame.runtime.reference import evaluate


@pytest.fixture(autouse=True)
def wide_sources_four(monkeypatch):
    """These tests pin the row-and-column kernel's fusion with ``materialize.WIDE_SOURCES`` at
    4, its value until session 19. At the default (1) a shared value whose recomputation reads
    two values of its size is written by the fusion pass before the row kernel's fusion sees it
    (materialize.py; measured faster on the DiT and UNet steps,
    notes/performance-session19.md)."""
    from flame.ir.passes import materialize

    monkeypatch.setattr(materialize, "WIDE_SOURCES", 4)


F = fl.nn.functional
DTYPES = {"float32": fl.float32, "float16": fl.float16, "bfloat16": fl.bfloat16}


def _layer_norm_fwd_bwd(rng, shape, dtype="float32"):
    """Tensors (y, dx, dw, db) of layer norm over the last axis and the gradients of
    sum(y * dy); built lazily, nothing runs."""
    cols = shape[-1]
    x = fl.tensor(rng.standard_normal(shape).astype(np.float32)).to(DTYPES[dtype])
    w = fl.tensor((1 + 0.1 * rng.standard_normal(cols)).astype(np.float32)).to(DTYPES[dtype])
    b = fl.tensor(rng.standard_normal(cols).astype(np.float32)).to(DTYPES[dtype])
    dy = fl.tensor(rng.standard_normal(shape).astype(np.float32)).to(DTYPES[dtype])
    kept = {}

    def objective(x, w, b):
        kept["y"] = F.layer_norm(x, (cols,), w, b, eps=1e-5)
        return fl.sum(kept["y"].to(fl.float32) * dy.to(fl.float32))

    _, grads = fl.value_and_grad(objective, argnums=(0, 1, 2))(x, w, b)
    return (kept["y"], *grads)


def _softmax_and_column_sum(rng, shape):
    """Not layer norm: a softmax over rows and a column sum of the same rows times g."""
    x = fl.tensor(rng.standard_normal(shape).astype(np.float32))
    g = fl.tensor(rng.standard_normal(shape).astype(np.float32))
    return F.softmax(x, -1), (x * g).sum(0)


def _many_rows_streamed(rng, shape):
    """Six row inputs: too many to cache the row in registers, so the rows stream while the
    strip sums stay in registers."""
    a, b, c, d, e, f = (fl.tensor(rng.standard_normal(shape).astype(np.float32)) for _ in "abcdef")
    total = (a * b + c * d + e * f).sum(-1, keepdim=True)
    return a - total * b + c * d - e * f, (a * f).sum(0)


def _ada_layer_norm_fwd_bwd(rng, shape, dtype="float32"):
    """A DiT block's adaLN over [N, T, D] tokens: layer norm without affine, then a scale
    and shift per sample; the gradients of the scale and shift sum over the tokens (a
    middle axis) of the rows the norm's backward reduces."""
    n, _, d = shape
    x = fl.tensor(rng.standard_normal(shape).astype(np.float32)).to(DTYPES[dtype])
    scale = fl.tensor(0.1 * rng.standard_normal((n, d)).astype(np.float32)).to(DTYPES[dtype])
    shift = fl.tensor(rng.standard_normal((n, d)).astype(np.float32)).to(DTYPES[dtype])
    dy = fl.tensor(rng.standard_normal(shape).astype(np.float32)).to(DTYPES[dtype])

    def objective(x, scale, shift):
        y = F.layer_norm(x, (d,), eps=1e-6) * (1 + scale[:, None]) + shift[:, None]
        return fl.sum(y.to(fl.float32) * dy.to(fl.float32))

    _, grads = fl.value_and_grad(objective, argnums=(0, 1, 2))(x, scale, shift)
    return grads


def _plan(outputs):
    return run_pipeline(Graph(tuple(t.node for t in outputs)), verify_each=True)


def _kinds(group):
    shapes = {node.inputs[0].shape for node in group.nodes if get_op(node.op).kind == "reduce"}
    return len(shapes)


def test_strips_divide_the_rows():
    assert _strips(16384) == 256
    assert _strips(4097) == 241  # 17 x 241: odd strips of 17 rows
    assert _strips(16381) is None  # a prime: the column kernel keeps its own split
    assert _strips(16384, 1024) == 1024  # strips of 16 rows for a short row's small blocks


def test_short_rows_aim_at_as_many_threads_in_smaller_blocks(monkeypatch):
    """A row kernel over rows of up to 1,024 four-lane values runs 128-thread blocks, so it
    takes 4x the strips of a 512-thread one (switch off: ROW_STRIPS for every row)."""
    assert [_strip_target(row) for row in (384, 1024, 1025, 2048, 4096)] == [
        4 * ROW_STRIPS, 4 * ROW_STRIPS, 2 * ROW_STRIPS, 2 * ROW_STRIPS, ROW_STRIPS,
    ]  # fmt: skip
    monkeypatch.setattr(split, "STRIPS_BY_THREADS", False)
    assert _strip_target(384) == ROW_STRIPS


def test_layer_norm_fwd_bwd_is_one_row_kernel_adding_atomically(cuda_backend, rng):
    """The default: the row kernel also takes over the sum of the strips' partial rows."""
    y, dx, dw, db = _layer_norm_fwd_bwd(rng, (16384, 4096))
    graph = _plan((y, dx, dw, db))
    assert len(graph.groups) == 1, [g.outputs for g in graph.groups]
    (rows,) = graph.groups
    assert _kinds(rows) == 3  # row statistics, strip sums and their totals in one kernel
    # y, dx, dw and db: no partial rows, no row statistics written
    assert [o.shape for o in rows.outputs] == [(16384, 4096)] * 2 + [(4096,)] * 2
    lowered = lower_group(rows, _layout_of)
    assert lowered.zeroed == (2, 3) and lowered.grid_items == 256
    spec = lowered.spec
    assert spec.extras["column_declare"] and spec.extras["min_blocks"] == 2
    stores = spec.extras["column_store"]  # a float4 atomic a chunk (scalar ones before sm_90)
    assert sum("atomicAdd(reinterpret_cast<float4*>" in line for line in stores) == 2
    assert sum(arg.kind == "in" for arg in spec.params) == 4  # x, w, b, dy


def test_deterministic_layer_norm_fwd_bwd_keeps_the_strip_sum(cuda_backend, rng):
    with fl.use_deterministic_algorithms(True):
        graph = _plan(_layer_norm_fwd_bwd(rng, (16384, 4096)))
    assert len(graph.groups) == 2, [g.outputs for g in graph.groups]
    rows, sums = graph.groups
    assert _kinds(rows) == 2  # row statistics and strip sums in one kernel
    # y, dx and one partial row per strip for dw and db: no row statistics written
    assert [o.shape for o in rows.outputs] == [(16384, 4096)] * 2 + [(256, 1, 4096)] * 2
    assert [o.shape for o in sums.outputs] == [(4096,), (4096,)]
    lowered = lower_group(rows, _layout_of)
    assert lowered.zeroed == () and lowered.grid_items == 256
    assert not any("atomic" in line for line in lowered.spec.extras["column_store"])


def test_deterministic_mode_is_scoped():
    assert not fl.are_deterministic_algorithms_enabled()  # the default: atomics allowed
    with fl.use_deterministic_algorithms(True):
        assert fl.are_deterministic_algorithms_enabled()
        with fl.use_deterministic_algorithms(False):
            assert not fl.are_deterministic_algorithms_enabled()
        assert fl.are_deterministic_algorithms_enabled()
    assert not fl.are_deterministic_algorithms_enabled()


def test_deterministic_mode_starts_from_the_environment():
    code = (
        "import flame as fl\n"
        "assert fl.are_deterministic_algorithms_enabled()\n"
        "with fl.use_deterministic_algorithms(False):\n"
        "    assert not fl.are_deterministic_algorithms_enabled()\n"
        "assert fl.are_deterministic_algorithms_enabled()\n"
    )
    environment = dict(os.environ, FLAME_DETERMINISTIC="1")
    done = subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()


def test_planned_peak_has_no_partial_rows(cuda_backend, rng):
    """Atomic: y, dx, dw and db only; deterministic: the 2 x 256 x 4096 partial rows too."""
    outputs = _layer_norm_fwd_bwd(rng, (16384, 4096))
    results = 2 * 16384 * 4096 * 4 + 2 * 4096 * 4
    assert planned_peak(_plan(outputs)) == results
    with fl.use_deterministic_algorithms(True):
        assert planned_peak(_plan(outputs)) == results + 2 * 256 * 4096 * 4


def test_three_d_layer_norm_joins_too(cuda_backend, rng):
    graph = _plan(_layer_norm_fwd_bwd(rng, (4, 2048, 512)))
    assert len(graph.groups) == 1
    assert _kinds(graph.groups[0]) == 3


def test_half_precision_sums_add_into_a_float32_total(cuda_backend, rng):
    """A bfloat16 dw is summed in float32 (split.py keeps 16-bit partial sums in float32):
    the strips add atomically into a float32 total, and a small kernel rounds it to
    bfloat16 once; no partial rows are written."""
    graph = _plan(_layer_norm_fwd_bwd(rng, (4096, 768), "bfloat16"))
    assert len(graph.groups) == 2
    rows, rounding = graph.groups
    totals = [(o.shape, o.dtype) for o in rows.outputs][2:]
    assert totals == [((1, 1, 768), fl.float32)] * 2
    assert [(o.op, o.dtype) for o in rounding.outputs] == [("cast", fl.bfloat16)] * 2


def test_softmax_and_a_column_sum_of_its_rows_share_a_kernel(cuda_backend, rng):
    graph = _plan(_softmax_and_column_sum(rng, (8192, 256)))
    assert len(graph.groups) == 1
    assert _kinds(graph.groups[0]) == 3


def test_long_rows_keep_a_column_kernel(cuda_backend, rng, monkeypatch):
    """Rows longer than the registers hold (x two column sums): the column sums keep a
    kernel of their own, which adds its partial sums into the float32 totals atomically
    (row_columns.PARTIAL_TOTALS; off: the totals are a third kernel, as before)."""
    cols = ROW_COLUMN_VALUES
    graph = _plan(_layer_norm_fwd_bwd(rng, (4096, cols)))
    assert len(graph.groups) == 2
    column = [group for group in graph.groups if _kinds(group) == 2]
    assert len(column) == 1
    assert lower_group(column[0], _layout_of).zeroed == (0, 1)
    monkeypatch.setattr(row_columns, "PARTIAL_TOTALS", False)
    graph = _plan(_layer_norm_fwd_bwd(rng, (4096, cols)))
    assert len(graph.groups) == 3
    assert all(_kinds(group) == 1 for group in graph.groups)


def test_few_rows_are_not_split(cuda_backend, rng):
    graph = _plan(_layer_norm_fwd_bwd(rng, (64, 256)))
    assert all(_kinds(group) == 1 for group in graph.groups)


BUILDS = [
    ("ln_16384x4096", lambda rng: _layer_norm_fwd_bwd(rng, (16384, 4096))),
    ("ln_odd_4097x96", lambda rng: _layer_norm_fwd_bwd(rng, (4097, 96))),
    ("ln_unaligned_4096x1003", lambda rng: _layer_norm_fwd_bwd(rng, (4096, 1003))),
    ("ln_3d", lambda rng: _layer_norm_fwd_bwd(rng, (4, 2048, 512))),
    ("ln_bf16", lambda rng: _layer_norm_fwd_bwd(rng, (4096, 768), "bfloat16")),
    ("ln_fp16", lambda rng: _layer_norm_fwd_bwd(rng, (8192, 512), "float16")),
    ("ln_long_rows", lambda rng: _layer_norm_fwd_bwd(rng, (4096, 2 * ROW_COLUMN_VALUES))),
    ("softmax_colsum", lambda rng: _softmax_and_column_sum(rng, (8192, 256))),
    ("adaln_64x256x384", lambda rng: _ada_layer_norm_fwd_bwd(rng, (64, 256, 384))),
    ("adaln_bf16_6x97x40", lambda rng: _ada_layer_norm_fwd_bwd(rng, (6, 97 * 8, 40), "bfloat16")),
    ("streamed_rows", lambda rng: _many_rows_streamed(rng, (4096, ROW_COLUMN_VALUES))),
]


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("name,build", BUILDS, ids=[b[0] for b in BUILDS])
def test_kernels_compile_with_nvrtc(name, build, deterministic, cuda_backend, rng, nvrtc):
    with fl.use_deterministic_algorithms(deterministic):
        graph = _plan(build(rng))
    for group in graph.groups:
        if group.kind == "library":
            continue
        spec = lower_group(group, _layout_of).spec
        assert nvrtc_compile(render(spec), spec.name, "sm_90")[:4] == b"\x7fELF"


def test_sums_over_tokens_of_few_samples_are_cut_into_more_strips(cuda_backend, rng):
    """adaLN's scale and shift gradients ([64, 256, 384] summed over the 256 tokens): the
    row kernel takes them over as strips, and 64 samples are cut into 4 strips each, so 256
    blocks walk 64 rows each instead of 64 blocks walking 256 (a small kernel then adds the
    4 partial rows of each sample). With 384-wide rows in 128-thread blocks: 16 strips a
    sample, 1,024 blocks of 16 rows."""
    graph = _plan(_ada_layer_norm_fwd_bwd(rng, (64, 256, 384)))
    rows = [g for g in graph.groups if g.kind == "reduce" and _kinds(g) == 2]
    assert len(rows) == 1, [g.outputs for g in graph.groups]
    strips = [o.shape for o in rows[0].outputs if len(o.shape) == 3 and o.shape[1] == 1]
    assert strips == [(1024, 1, 384)] * 2
    assert lower_group(rows[0], _layout_of).grid_items == 1024
    totals = [g for g in graph.groups if g is not rows[0] and g.kind == "reduce"]
    assert sorted(o.shape for g in totals for o in g.outputs) == [(64, 384)] * 2


def test_streamed_rows_still_join(cuda_backend, rng):
    graph = _plan(_many_rows_streamed(rng, (4096, ROW_COLUMN_VALUES)))
    assert len(graph.groups) == 1
    spec = lower_group(graph.groups[0], _layout_of).spec
    assert spec.extras["cache_items"] == 0 and spec.extras["loop_items"] > 0


# --- gpu tier: values ---------------------------------------------------------------------

TOLERANCE = {"float32": 2e-4, "float16": 2e-2, "bfloat16": 6e-2}


def _relative_error(result, expected):
    result, expected = np.asarray(result, np.float64), np.asarray(expected, np.float64)
    return np.linalg.norm(result - expected) / max(np.linalg.norm(expected), 1e-30)


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("name,build", BUILDS, ids=[b[0] for b in BUILDS])
def test_gpu_values_match_the_reference(name, build, deterministic, rng):
    with fl.use_deterministic_algorithms(deterministic):
        outputs = build(rng)
        expected = evaluate([t.node for t in outputs], precision=np.float64, realized=False)
        fl.realize(*outputs)
    dtype = "bfloat16" if "bf16" in name else "float16" if "fp16" in name else "float32"
    for tensor, reference in zip(outputs, expected):
        result = tensor.to(fl.float32).numpy()
        assert np.isfinite(result).all()
        assert _relative_error(result, reference) < TOLERANCE[dtype], name


@pytest.mark.gpu
def test_gpu_strip_sums_are_deterministic():
    """Deterministic mode: no atomics, the same inputs give the same bits on every run (the
    two runs share one plan, as a training loop would)."""
    runs = []
    with fl.use_deterministic_algorithms(True):
        for _ in range(2):
            outputs = _layer_norm_fwd_bwd(np.random.default_rng(7), (8192, 1024))
            fl.realize(*outputs)
            runs.append([t.numpy() for t in outputs])
    for first, second in zip(*runs):
        np.testing.assert_array_equal(first, second)


@pytest.mark.gpu
def test_gpu_plans_of_the_two_modes_are_kept_apart():
    """The executor's plan cache keys on the mode: one kernel by default, two when
    deterministic, for the same graph; the atomic sums stay close to the ordered ones."""
    from flame.runtime.executor import default_executor
    from flame.runtime.walks import linearize

    results, launches = [], []
    for deterministic in (False, True, False):
        with fl.use_deterministic_algorithms(deterministic):
            outputs = _layer_norm_fwd_bwd(np.random.default_rng(11), (4096, 512))
            pending = [t.node for t in outputs]
            _, inputs, key = linearize(pending)
            launches.append(len(default_executor().plan_for(pending, inputs, key).launches))
            fl.realize(*outputs)
            results.append([t.numpy() for t in outputs])
    assert launches == [1, 2, 1]
    for atomic, ordered in zip(results[0], results[1]):
        assert _relative_error(atomic, ordered) < 1e-5
