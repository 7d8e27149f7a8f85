"""A compiled step planned again at a new size reuses the fusion pass's decisions.

flame/ir/structure.py keys a graph by its structure with sizes erased; flame/ir/passes/
reuse.py keeps the fusion pass's groups by that key and applies them to a later graph of the
same structure, where each group's shapes still relate as they did (notes/plan-reuse.md).

The CPU tier plans ``fl.compile``d steps on the CUDA backend without a GPU (as
tests/test_new_resolution.py does) and checks every plan by running its groups one by one
with the reference interpreter: each group computes its outputs from the graph's inputs and
what earlier groups wrote, nothing else (``run_groups``), and the results are those of the
uncompiled computation. Plans made with reused decisions are compared with plans made with
reuse switched off (``FLAME_PLAN_REUSE=0``).
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import flame as fl
import flame.nn.functional as F
from flame.ir import dtypes
from flame.ir.graph import Graph, is_input
from flame.ir.passes import fuse as fuse_module
from flame.ir.passes import reuse
from flame.ir.structure import first_difference, structure_key
from flame.ir.views import MOVEMENT_OPS
from flame.runtime import executor as executor_module
from flame.runtime import launch, reference
from flame.runtime.cache import DiskCache
from flame.runtime.compiler import KernelCache
from flame.runtime.device import DeviceInfo
from flame.runtime.executor import Executor
from flame.runtime.storage import Storage
from flame.tensor import apply

FAKE_DEVICE = DeviceInfo("CPU stand-in for an H100", "sm_90", 132, 50 * 2**20)


class PlanningExecutor(Executor):
    """Plans as the GPU does, loads no kernel, and keeps every plan and kernel key."""

    def _load(self, sources):
        self.loaded.extend(key for _, _, key, _ in sources)
        return [("function of", key) for _, _, key, _ in sources]

    def _plan(self, pending, inputs):
        plan = super()._plan(pending, inputs)
        values = {id(stand_in): reference.input_value(node) for stand_in, node in zip(
            plan.inputs, inputs)}  # fmt: skip
        self.made.append((plan, values))
        return plan


def _realize_on_reference(nodes):
    reference.realize(nodes, lambda dtype, array: Storage("cuda", dtype, host=array))


@pytest.fixture
def planning(monkeypatch, tmp_path):
    """``fl.compile`` on the CUDA backend plans without a GPU, with an executor of its own
    (its own decisions and kernel cache); all of it for this test only."""
    monkeypatch.setenv("FLAME_SIBLING_CLASSES", "0")
    monkeypatch.setenv("FLAME_PLAN_CACHE", "0")
    monkeypatch.delenv("FLAME_PLAN_REUSE", raising=False)
    monkeypatch.setattr(launch, "device_info", lambda: FAKE_DEVICE)
    backend_module = importlib.import_module("flame.backend")  # fl.backend is a function
    monkeypatch.setattr(backend_module, "_realize_on_gpu", _realize_on_reference)
    executor = PlanningExecutor(KernelCache(DiskCache(tmp_path), arch="sm_90"))
    executor.loaded, executor.made = [], []
    monkeypatch.setattr(executor_module, "_executor", executor)
    state = Storage("cuda", dtypes.int64, host=np.zeros(2, np.int64))
    monkeypatch.setitem(fl.random.default_generator._states, "cuda", state)
    with fl.backend("cuda"):
        yield executor


def run_groups(graph: Graph, inputs: dict) -> list[np.ndarray]:
    """The graph's outputs computed group by group, in the plan's order: each group from the
    graph's ``inputs`` (``id`` -> array) and the values earlier groups wrote (read directly
    or through views), as the plan's kernels would. Fails where a group reads a value
    nothing wrote before it."""
    written: dict[int, np.ndarray] = dict(inputs)
    assert all(id(node) in written for node in graph.nodes if is_input(node))
    for index, group in enumerate(graph.groups):
        members = {id(node) for node in group.nodes}
        for node in group.nodes:
            for child in node.inputs:
                if id(child) not in members:
                    assert _readable(child, written), (
                        f"group {index} ({group.kind}) reads {child} before anything wrote it"
                    )  # fmt: skip
        values = reference.evaluate(list(group.outputs), inputs=written)
        for node, value in zip(group.outputs, values):
            written[id(node)] = value
    for node in graph.outputs:
        assert _readable(node, written), f"output {node} is written by no group"
    return reference.evaluate(list(graph.outputs), inputs=written)


def _readable(node, written) -> bool:
    """Written, or a view of a written value (a constant a kernel reads is its member)."""
    while id(node) not in written and node.op in MOVEMENT_OPS and node.inputs:
        node = node.inputs[0]
    return id(node) in written


def check_plans(plans) -> None:
    """Every plan's groups give the values of its graph computed node by node."""
    assert plans, "nothing was planned"
    for plan, inputs in plans:
        expected = reference.evaluate(list(plan.graph.outputs), inputs=inputs)
        for got, want in zip(run_groups(plan.graph, inputs), expected, strict=True):
            np.testing.assert_array_equal(got, want)


def call(executor, step, *arrays):
    """Plans of ``step``'s first call with ``arrays`` (planned; running needs a GPU)."""
    del executor.made[:]
    del executor.loaded[:]
    try:
        step(*(fl.from_numpy(array) for array in arrays))
    except Exception:  # noqa: BLE001  planned; the launch needs a GPU
        pass
    return list(executor.made)


def _diffusion_step():
    """bench.diffusion's step in small: timesteps, noise, a GroupNorm + SiLU, a convolution,
    dropout and a mean-squared error, with its gradient and an SGD update of the weights."""
    rng = np.random.default_rng(0)
    weight = fl.tensor(np.linspace(0.5, 1.5, 8, dtype=np.float32), requires_grad=True)
    bias = fl.tensor(np.linspace(-0.1, 0.1, 8, dtype=np.float32), requires_grad=True)
    kernel = fl.tensor(rng.standard_normal((8, 8, 3, 3)).astype(np.float32) * 0.1)
    kernel.requires_grad = True

    @fl.compile
    def step(images):
        steps = fl.randint(0, 1000, (images.shape[0],))
        noise = fl.randn(images.shape)
        hidden = F.silu(F.group_norm(images + noise, 4, weight, bias))
        hidden = F.conv2d(hidden, kernel, padding=1)
        hidden = F.dropout(hidden, 0.1, training=True)
        loss = ((hidden - noise) ** 2).mean() + steps.float().mean() * 1e-3
        loss.backward()
        with fl.no_grad():
            for parameter in (weight, bias, kernel):
                parameter -= 0.01 * parameter.grad
                parameter.grad = None
        return loss

    return step


SHAPES = [(2, 8, 8, 8), (3, 8, 8, 8), (2, 8, 12, 12), (5, 8, 16, 16)]


def _images(shape):
    return np.linspace(-1, 1, int(np.prod(shape)), dtype=np.float32).reshape(shape)


# --- the structure key ------------------------------------------------------------------------


def _graph(function, *shapes):
    with fl.backend("cuda"):
        inputs = [fl.from_numpy(np.ones(shape, np.float32)) for shape in shapes]
        outputs = function(*inputs)
    return Graph(tuple(tensor.node for tensor in outputs))


def _norm(x):
    return [F.silu(F.group_norm(x, 2)) * 2.0 + x.mean()]


def test_the_key_erases_sizes():
    key = structure_key(_graph(_norm, (2, 4, 8, 8)))
    assert structure_key(_graph(_norm, (3, 4, 16, 16))) == key
    assert structure_key(_graph(_norm, (2, 4, 8, 12))) == key


def test_the_key_keeps_the_broadcast_pattern_and_ops():
    key = structure_key(_graph(_norm, (2, 4, 8, 8)))
    other = structure_key(_graph(_norm, (1, 4, 8, 8)))  # a batch of 1: another pattern
    assert first_difference(key, other) is not None
    sums = structure_key(_graph(lambda x: [x.sum(1) * 2.0], (2, 4)))
    products = structure_key(_graph(lambda x: [x.sum(0) * 2.0], (2, 4)))
    assert "axes" in first_difference(sums, products)


def test_the_key_keeps_where_a_slice_starts():
    def head(x):
        return [x[:, :2] * 2.0]

    def tail(x):
        return [x[:, 2:4] * 2.0]

    assert structure_key(_graph(head, (3, 6))) == structure_key(_graph(head, (5, 9)))
    assert structure_key(_graph(head, (3, 6))) != structure_key(_graph(tail, (3, 6)))


def _draw(offset: int, count: int):
    """A compiled step's draw: ``philox(seed, arange + (state offset + offset))``, where
    ``offset`` counts the numbers drawn before it (tests/test_new_resolution.py)."""
    state = fl.from_numpy(np.array([7, 0], np.int64))
    counter = fl.arange(count, dtype=fl.int64) + (state[1] + offset)
    bits = apply("philox", state[0].expand(count), counter, word=0)
    return [bits.to(fl.float32).mean() * 2.0]


def test_a_size_constant_and_a_draw_offset_are_sizes():
    with fl.backend("cuda"):
        small = Graph(tuple(t.node for t in _draw(16, 96)))
        large = Graph(tuple(t.node for t in _draw(61603840, 50)))
        first = Graph(tuple(t.node for t in _draw(0, 96)))  # no offset: folded away
    assert structure_key(small) == structure_key(large)
    assert structure_key(small) != structure_key(first)


# --- reuse in a compiled step -----------------------------------------------------------------


def test_a_new_size_reuses_the_fusion_and_plans_valid_groups(planning, monkeypatch):
    fusions = []
    anew = fuse_module.fuse_anew
    monkeypatch.setattr(fuse_module, "fuse_anew", lambda *a: fusions.append(1) or anew(*a))
    step = _diffusion_step()
    check_plans(call(planning, step, _images(SHAPES[0])))
    first = len(fusions)
    assert first > 0 and planning.decisions.fused > 0
    for shape in SHAPES[1:]:
        reused, count = planning.decisions.reused, len(fusions)
        plans = call(planning, step, _images(shape))
        check_plans(plans)
        assert planning.decisions.reused > reused, f"{shape}: no fusion reused"
        assert len(fusions) == count, f"{shape}: the fusion pass ran ({len(fusions) - count}x)"


def _plans_and_kernels(planning, monkeypatch, reuse_on: bool):
    monkeypatch.setenv("FLAME_PLAN_REUSE", "1" if reuse_on else "0")
    step = _diffusion_step()
    found = []
    for shape in SHAPES:
        plans = call(planning, step, _images(shape))
        found.append((plans, set(planning.loaded)))
    return found


def test_reused_plans_give_the_values_and_kernels_of_fresh_ones(planning, monkeypatch):
    """Plans made at each new size with the first size's decisions: the same values as the
    plans made from scratch, and no kernel a fresh plan of these sizes does not have."""
    with_reuse = _plans_and_kernels(planning, monkeypatch, True)
    assert planning.decisions.reused > 0
    fresh_executor = PlanningExecutor(planning.kernels)
    fresh_executor.loaded, fresh_executor.made = [], []
    monkeypatch.setattr(executor_module, "_executor", fresh_executor)
    without = _plans_and_kernels(fresh_executor, monkeypatch, False)
    assert fresh_executor.decisions.reused == fresh_executor.decisions.fused == 0
    for shape, (plans, kernels), (fresh, fresh_kernels) in zip(SHAPES, with_reuse, without):
        assert len(plans) == len(fresh)
        for (plan, inputs), (other, other_inputs) in zip(plans, fresh):
            got_values = run_groups(plan.graph, inputs)
            for got, want in zip(got_values, run_groups(other.graph, other_inputs), strict=True):
                np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
        assert kernels <= fresh_kernels | with_reuse[0][1], f"{shape}: kernels no plan had"


def test_shapes_equal_by_coincidence_refuse_the_grouping(planning):
    """At n=8 the [n, 8] and [8, 8] values share a shape and one kernel; at n=4 they do not:
    the recorded grouping is refused and the step fused again, with valid groups."""

    @fl.compile
    def step(x, w):
        return (x * 2.0).exp(), (w * 3.0).exp()

    square = np.ones((8, 8), np.float32)
    plans = call(planning, step, square, square)
    check_plans(plans)
    shared = [g for plan, _ in plans for g in plan.graph.groups if len(g.outputs) == 2]
    assert shared, "the two values were not one kernel where their shapes coincide"
    refused = planning.decisions.refused
    plans = call(planning, step, np.ones((4, 8), np.float32), square)
    check_plans(plans)
    assert planning.decisions.refused > refused
    groups = [group for plan, _ in plans for group in plan.graph.groups]
    assert all(len({out.shape for out in group.outputs}) == 1 for group in groups)


def test_constants_equal_at_one_size_only(planning):
    """At a batch of 3 the noise's counter offset (3 numbers drawn before it) and the
    literal 3 are one constant node (CSE); at a batch of 2 they are two. The grouping made
    at 3 computes both constants in its kernel at 2."""

    @fl.compile
    def step(x):
        steps = fl.randint(0, 1000, (x.shape[0],))
        noise = fl.randn((x.shape[0],))
        return ((x + noise) * (steps + 3).float()).sum()

    check_plans(call(planning, step, np.ones(3, np.float32)))
    reused = planning.decisions.reused
    check_plans(call(planning, step, np.ones(2, np.float32)))
    assert planning.decisions.reused > reused


def test_a_structure_change_fuses_in_full(planning):
    """A batch of 1 broadcasts where a larger batch does not: another structure, no reuse."""
    step = _diffusion_step()
    call(planning, step, _images(SHAPES[0]))
    fused = planning.decisions.fused
    check_plans(call(planning, step, _images((1, 8, 8, 8))))
    assert planning.decisions.fused > fused


def test_reuse_switched_off_and_cleared(planning, monkeypatch):
    monkeypatch.setenv("FLAME_PLAN_REUSE", "0")
    step = _diffusion_step()
    for shape in SHAPES[:2]:
        check_plans(call(planning, step, _images(shape)))
    assert (planning.decisions.reused, planning.decisions.fused) == (0, 0)
    monkeypatch.setenv("FLAME_PLAN_REUSE", "1")
    call(planning, step, _images(SHAPES[2]))
    assert planning.decisions.fused > 0
    planning.decisions.clear()
    assert (planning.decisions.reused, planning.decisions.fused) == (0, 0)
    call(planning, step, _images(SHAPES[3]))
    assert planning.decisions.reused == 0


def test_each_executor_owns_its_decisions(tmp_path):
    kernels = KernelCache(DiskCache(tmp_path), arch="sm_90")
    assert Executor(kernels).decisions is not Executor(kernels).decisions
    assert reuse.current() is None  # none outside a pipeline run


# --- random programs at two sizes -------------------------------------------------------------

# symbolic shapes of a program over sizes n, m: [n, m], [n, 1], [1, m]
ROWS, COLUMNS, FULL = "n1", "1m", "nm"


def _broadcast(*kinds) -> str:
    if len(set(kinds)) == 1:
        return kinds[0]
    return FULL


def _program_step(draw, values):
    """One step over ``values`` (``(tensor, kind)`` pairs): an elementwise op, a row or
    column sum or mean (kept as 1), a softmax over rows, a reshape round trip, or work on
    the transpose."""
    choices = ["unary", "binary", "sum", "mean", "softmax", "reshape", "transpose"]
    choice = draw(st.sampled_from(choices))
    tensor, kind = values[draw(st.integers(0, len(values) - 1))]
    if choice == "unary":
        op = draw(st.sampled_from(["exp", "tanh", "neg", "sigmoid"]))
        return (getattr(fl, op)(tensor.tanh()) if op == "exp" else getattr(fl, op)(tensor)), kind
    if choice == "binary":
        other, other_kind = values[draw(st.integers(0, len(values) - 1))]
        op = draw(st.sampled_from(["add", "mul", "sub"]))
        return getattr(fl, op)(tensor, other), _broadcast(kind, other_kind)
    if kind != FULL:
        return tensor * 1.5, kind
    if choice in ("sum", "mean"):
        axis = draw(st.integers(0, 1))
        return getattr(tensor, choice)(axis, keepdim=True), (COLUMNS if axis == 0 else ROWS)
    if choice == "softmax":
        shifted = tensor - tensor.amax(1, keepdim=True)
        return shifted.exp() / shifted.exp().sum(1, keepdim=True), FULL
    if choice == "transpose":  # [m, n] in between: [n, m]'s shape where n == m
        flipped = tensor.T.exp() + tensor.T.sum(0, keepdim=True)
        return flipped.T, FULL
    rows, columns = tensor.shape
    return (tensor.reshape(rows * columns) * 2.0).reshape(rows, columns), FULL


def _build(program_draw, sizes):
    rows, columns = sizes
    rng = np.random.default_rng(0)
    values = [
        (fl.from_numpy(rng.standard_normal((rows, columns)).astype(np.float32)), FULL),
        (fl.from_numpy(rng.standard_normal((rows, 1)).astype(np.float32)), ROWS),
        (fl.from_numpy(rng.standard_normal((1, columns)).astype(np.float32)), COLUMNS),
    ]
    for _ in range(program_draw.steps):
        values.append(_program_step(program_draw.draw, values))
    picks = program_draw.outputs
    return [values[3 + pick % (len(values) - 3)][0] for pick in picks]


class _Replay:
    """A recorded hypothesis draw, replayed at another size (the same choices)."""

    def __init__(self, data, steps, outputs):
        self.choices: list = []
        self.data, self.steps, self.outputs = data, steps, outputs
        self.replaying = False
        self.index = 0

    def draw(self, strategy):
        if self.replaying:
            value = self.choices[self.index]
            self.index += 1
            return value
        value = self.data.draw(strategy)
        self.choices.append(value)
        return value


SIZES = [(4, 4), (3, 5), (5, 3), (6, 2), (8, 8), (2, 7)]


@settings(max_examples=60, deadline=None, database=None)
@given(st.data(), st.integers(2, 9), st.lists(st.integers(0, 20), min_size=1, max_size=3),
       st.sampled_from(SIZES), st.sampled_from(SIZES))  # fmt: skip
def test_random_programs_reuse_valid_groupings(data, steps, outputs, first, second):
    """A random program of broadcasts, row and column reductions, softmaxes and reshapes,
    planned at one size and then at another with one ``Decisions``: at the second size
    every group computes from what earlier groups wrote, the values are the graph's, and
    every group lowers."""
    from flame.codegen.lower import lower_group
    from flame.ir.passes import run_pipeline
    from flame.runtime.executor import _layout_of

    decisions = reuse.Decisions()
    replay = _Replay(data, steps, outputs)
    for sizes in (first, second):
        with fl.backend("cuda"):
            tensors = _build(replay, sizes)
        replay.replaying, replay.index = True, 0
        graph = run_pipeline(Graph(tuple(t.node for t in tensors)), decisions=decisions)
        inputs = {id(node): reference.input_value(node) for node in graph.nodes if is_input(node)}
        expected = reference.evaluate(list(graph.outputs), inputs=inputs)
        for got, want in zip(run_groups(graph, inputs), expected, strict=True):
            np.testing.assert_array_equal(got, want)
        for group in graph.groups:
            if group.kind != "library":
                lower_group(group, _layout_of)
