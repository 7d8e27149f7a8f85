"""The host fast paths of lazy mode keep their behaviour: sites at the user's line (from the
memoized line table), results detached under no_grad, fallbacks for promotion, broadcasting
and errors, and ``linearize`` giving one key whether it walks recursively or with a stack.
Speed itself is measured in bench/ (``python -m bench.lazy_profile``), never asserted here."""

from __future__ import annotations

import sys

import numpy as np
import pytest

import flame as fl
from flame.ir.node import format_site, user_site
from flame.runtime.walks import (
    COMPILE_AFTER,
    COMPILED_WALK_LIMIT,
    RecordedWalk,
    compile_walk,
    linearize,
    match_walk,
    record_walk,
)


def _line() -> int:
    return sys._getframe(1).f_lineno


@pytest.fixture
def xy(reference_backend):
    x = fl.tensor(np.arange(4, dtype=np.float32)).realize()
    y = fl.tensor(np.ones(4, dtype=np.float32)).realize()
    return x, y


def test_fast_path_sites_are_the_users_line(xy):
    x, y = xy
    here = _line()
    products = [x * y, x * 2.0, 3 - x, -x, fl.tanh(x), x.sigmoid(), fl.add(x, y)]
    for value in products:
        assert value.node.site == (__file__, here + 1)
    for line_offset in range(3):  # one code offset per line: the memo never mixes them up
        value = x + y
        assert value.node.site == (__file__, _line() - 1)
        del line_offset


def test_sites_of_equal_offsets_in_different_code_objects(xy):
    x, y = xy
    namespace = {"x": x, "y": y}
    exec(compile("value = x * y", "<generated>", "exec"), namespace)
    first = namespace["value"].node.site
    exec(compile("\n\nvalue = x * y", "<generated>", "exec"), namespace)
    second = namespace["value"].node.site
    assert first == ("<generated>", 1)
    assert second == ("<generated>", 3)


def test_sites_through_flame_code_walk_out_to_the_user(xy):
    x, _ = xy
    here = _line()
    value = fl.nn.functional.gelu(x) if hasattr(fl.nn.functional, "gelu") else fl.gelu(x)
    assert value.node.site == (__file__, here + 1)
    assert format_site(user_site()) == f"test_host_cost.py:{_line()}"


def test_fast_paths_detach_under_no_grad(xy):
    x, y = xy
    with fl.no_grad():
        for value in (x * y, x * 2.0, -x, fl.exp(x)):
            assert value.node.op == "detach"
    assert (x * y).node.op == "mul"


def test_fallbacks_promote_broadcast_and_report(xy, reference_backend):
    x, _ = xy
    ints = fl.tensor(np.arange(4, dtype=np.int32))
    assert (ints * 2).dtype is fl.int32
    assert (ints * 2.5).dtype is fl.float32
    assert fl.exp(ints).dtype is fl.float32
    row = fl.tensor(np.ones((3, 1), dtype=np.float32))
    assert (x + row).shape == (3, 4)
    np.testing.assert_allclose((x + row).numpy(), np.arange(4, dtype=np.float32) + np.ones((3, 1)))
    with pytest.raises(Exception, match=r"test_host_cost\.py:\d+"):
        x + fl.tensor(np.ones(5, dtype=np.float32))


def _graph(x, y):
    a = x * y
    b = fl.tanh(a) + x
    c = b * b - a
    d = fl.sigmoid(c) * 0.5 + y
    for _ in range(40):  # deeper than the headroom left below
        d = d * y + c
    return [d, c, d]  # two outputs, one repeated


def _at_depth(depth: int, function):
    """Call ``function`` with ``depth`` more frames on the stack."""
    if depth <= 0:
        return function()
    return _at_depth(depth - 1, function)


def test_linearize_same_key_recursive_and_with_a_stack(xy):
    x, y = xy
    nodes = [value.node for value in _graph(x, y)]
    order, inputs, key = linearize(nodes)
    # Near the recursion limit the recursive walk fails and the stack walk takes over.
    headroom = 16
    depth = sys.getrecursionlimit() - len(_stack()) - headroom
    deep_order, deep_inputs, deep_key = _at_depth(depth, lambda: linearize(nodes))
    assert deep_key == key
    assert [id(n) for n in deep_order] == [id(n) for n in order]
    assert [id(n) for n in deep_inputs] == [id(n) for n in inputs]
    assert len(order) == len({id(n) for n in order})
    positions = {id(n): index for index, n in enumerate(order)}
    for node in order:  # inputs before users
        if node.buffer is None and node.op != "buffer":
            assert all(positions[id(child)] < positions[id(node)] for child in node.inputs)


def _stack() -> list:
    frames, frame = [], sys._getframe(1)
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return frames


def test_linearize_a_chain_deeper_than_the_recursion_limit(xy):
    x, y = xy
    value = x
    for _ in range(sys.getrecursionlimit() + 200):
        value = value * y
    order, inputs, key = linearize([value.node])
    assert len(order) == sys.getrecursionlimit() + 202
    assert [id(n) for n in inputs] == [id(x.node), id(y.node)]
    assert key[2] == ("mul", (), 0, 1)
    assert key[-1] == (len(order) - 1,)


def test_linearize_key_separates_structures(xy):
    x, y = xy
    keys = {
        linearize([(x * y).node])[2],
        linearize([(y * x).node])[2],
        linearize([(x * x).node])[2],
        linearize([(x + y).node])[2],
        linearize([(x * 2.0).node])[2],
        linearize([(x * 3.0).node])[2],
    }
    assert len(keys) == 5 or len(keys) == 6  # x*y and y*x: same structure, same layout
    assert linearize([(x * y).node])[2] == linearize([(y * x).node])[2]
    assert linearize([(x * y).node])[2] != linearize([(x * x).node])[2]


# --- recorded walks: lazy mode's check of a graph against the last one built at its line ---


def _recorded(value):
    order, _, key = linearize([value.node])
    return record_walk(order, key)


def _compiled_match(entries, root):
    """``match_walk`` through the matcher generated for ``entries`` (one root), and through
    the several-roots form with the root at position 0: both must answer as the loop does."""
    single = compile_walk(entries)(root)
    several = compile_walk(entries, (0,))([root])
    assert _inputs_ids(single) == _inputs_ids(several)
    return single


@pytest.fixture(params=["loop", "compiled"])
def match(request):
    """Each recorded-walk test runs with the loop (``match_walk``) and the generated matcher."""
    return match_walk if request.param == "loop" else _compiled_match


def _inputs_ids(nodes):
    return None if nodes is None else [id(node) for node in nodes]


def test_recorded_walk_matches_the_same_expression_built_again(xy, match):
    x, y = xy
    entries = _recorded(fl.tanh(x * y + 2.0) * x - fl.exp(y))
    again = fl.tanh(x * y + 2.0) * x - fl.exp(y)
    _, inputs, _ = linearize([again.node])
    assert _inputs_ids(match(entries, again.node)) == _inputs_ids(inputs)


def test_recorded_walk_takes_other_inputs_of_the_same_type_and_layout(xy, match):
    x, y = xy
    z = fl.tensor(np.full(4, 3.0, dtype=np.float32)).realize()
    entries = _recorded(x * y + 1.0)
    assert _inputs_ids(match(entries, (z * x + 1.0).node)) == _inputs_ids([z.node, x.node])


def test_recorded_walk_rejects_every_difference_the_plan_key_holds(xy, match):
    x, y = xy
    entries = _recorded(fl.leaky_relu(x * y, 0.1) + 1.0)
    columns = fl.tensor(np.arange(8, dtype=np.float32).reshape(2, 4)).realize()
    strided = fl.tensor(np.arange(8, dtype=np.float32)).realize()[::2]
    halves = fl.tensor(np.ones(4, dtype=np.float16)).realize()
    different = {
        "op": fl.leaky_relu(x + y, 0.1) + 1.0,
        "constant": fl.leaky_relu(x * y, 0.1) + 2.0,
        "order of operands": fl.leaky_relu(x * y, 0.1) * 1.0,
        "shape": fl.leaky_relu(columns * columns, 0.1) + 1.0,
        "layout": fl.leaky_relu(strided * y, 0.1) + 1.0,
        "dtype": fl.leaky_relu(halves.to(fl.float32) * y, 0.1) + 1.0,
        "depth": fl.leaky_relu(fl.exp(x) * y, 0.1) + 1.0,
        "attribute": fl.leaky_relu(x * y, 0.2) + 1.0,
    }
    for name, value in different.items():
        assert match(entries, value.node) is None, name


def test_recorded_walk_rejects_less_sharing_and_realized_values(xy, match):
    x, y = xy
    assert match(_recorded(x * x), (x * y).node) is None
    product = x * y
    entries = _recorded(product + 1.0)
    realized = x * y
    realized.realize()  # now an input of the next graph, not a product to compute
    assert match(entries, (realized + 1.0).node) is None
    unrealized = x * y
    assert match(_recorded(realized + 1.0), (unrealized + 1.0).node) is None


def test_recorded_walk_rejects_more_sharing(xy, match):
    """The recorded plan would compute work over a shared input twice (exp(x) at both
    positions of exp(x) + exp(y)); a graph that shares more is walked anew and planned."""
    x, y = xy
    entries = _recorded(fl.exp(x) + fl.exp(y))
    shared = fl.exp(x)
    assert match(entries, (shared + shared).node) is None
    assert match(entries, (fl.exp(x) + fl.exp(x)).node) is None
    assert match(_recorded(x * y), (x * x).node) is None
    assert _inputs_ids(match(_recorded(x * x), (y * y).node)) == _inputs_ids([y.node])


def _random_program(rng, leaves: int, length: int) -> list:
    program = []
    for index in range(length):
        available = leaves + index
        kind = rng.integers(4)
        if kind == 0:
            program.append(("exp", int(rng.integers(available))))
        elif kind == 1:
            program.append(("mul", int(rng.integers(available)), int(rng.integers(available))))
        elif kind == 2:
            program.append(("add", int(rng.integers(available)), int(rng.integers(available))))
        else:
            program.append(("scale", int(rng.integers(available)), float(rng.integers(1, 3))))
    return program


def _build(program, leaves: list):
    values = list(leaves)
    for step in program:
        if step[0] == "exp":
            values.append(fl.exp(values[step[1]]))
        elif step[0] == "mul":
            values.append(values[step[1]] * values[step[2]])
        elif step[0] == "add":
            values.append(values[step[1]] + values[step[2]])
        else:
            values.append(values[step[1]] * step[2])
    return values[-1]


def _mutated(rng, program: list, leaves: int) -> list:
    program = list(program)
    position = int(rng.integers(len(program)))
    step = list(program[position])
    field = int(rng.integers(1, len(step)))
    if isinstance(step[field], float):
        step[field] = 3.0 - step[field]
    else:
        step[field] = int(rng.integers(leaves + position))
    program[position] = tuple(step)
    return program


def test_recorded_walk_agrees_with_linearize_on_random_graphs(xy, match):
    """Equal keys: the walk matches and finds linearize's inputs; other keys: no match."""
    x, y = xy
    z = fl.tensor(np.full(4, 0.5, dtype=np.float32)).realize()
    rng = np.random.default_rng(7)
    matched = rejected = 0
    for _ in range(300):
        program = _random_program(rng, 3, int(rng.integers(1, 12)))
        first = _build(program, [x, y, z])
        order, _, key = linearize([first.node])
        entries = record_walk(order, key)
        second_program = program if rng.random() < 0.3 else _mutated(rng, program, 3)
        leaves = [x, y, z] if rng.random() < 0.7 else [z, x, y]
        second = _build(second_program, leaves)
        second_order, second_inputs, second_key = linearize([second.node])
        got = match(entries, second.node)
        if second_key == key:
            assert _inputs_ids(got) == _inputs_ids(second_inputs)
        else:
            assert got is None, (program, second_program)
        matched += got is not None
        rejected += got is None
    assert matched > 50 and rejected > 50  # both sides of the check were exercised


def test_nan_constants_made_anew_give_one_plan_key(xy):
    # NaN != NaN and hashes by identity: each step's float("nan") must not be a new plan
    x, _ = xy
    keys = []
    for _ in range(2):
        masked = fl.where(x > 1.0, x * float("nan"), x + float("nan") * 0 + 1.0)
        keys.append(linearize([masked.node])[2])
    assert keys[0] == keys[1]
    assert hash(keys[0]) == hash(keys[1])
    value = fl.where(x > 1.0, x * float("nan"), x).numpy()
    assert np.isnan(value[2:]).all() and not np.isnan(value[:2]).any()


def test_compiled_walk_takes_several_roots_as_the_loop_does(xy):
    x, y = xy
    shared = x * y
    roots = [fl.exp(shared).node, (shared + 1.0).node, shared.node]
    order, inputs, key = linearize(roots)
    entries = record_walk(order, key)
    positions = tuple(len(order) - 1 - index for index in key[-1])
    shared_again = x * y
    again = [fl.exp(shared_again).node, (shared_again + 1.0).node, shared_again.node]
    matcher = compile_walk(entries, positions)
    assert _inputs_ids(matcher(again)) == _inputs_ids(match_walk(entries, again, positions))
    assert _inputs_ids(matcher(again)) == _inputs_ids(linearize(again)[1])
    unshared = [fl.exp(x * y).node, (x * y + 1.0).node, (x * y).node]  # less sharing
    assert matcher(unshared) is None and match_walk(entries, unshared, positions) is None
    assert matcher(again[:2]) is None  # a root missing
    swapped = [again[1], again[0], again[2]]
    assert matcher(swapped) is None and match_walk(entries, swapped, positions) is None


def test_compiled_walk_refuses_what_it_cannot_compile(xy):
    x, _ = xy
    value = x
    for _ in range(COMPILED_WALK_LIMIT):
        value = fl.exp(value)
    assert compile_walk(_recorded(value)) is None  # too long: the loop keeps matching it
    entries = _recorded(x * 2.0)
    assert compile_walk(entries, (0, 0)) is None  # two roots at one position


def test_recorded_walk_compiles_its_matcher_after_repeated_matches(xy):
    x, y = xy
    order, _, key = linearize([(x * y + 1.0).node])
    walk = RecordedWalk(record_walk(order, key), plan=None, positions=(0,))
    for count in range(COMPILE_AFTER):
        assert walk.matcher is None
        assert walk.match([(x * y + 2.0).node]) is None  # a miss never counts
        again = x * y + 1.0
        assert _inputs_ids(walk.match([again.node])) == _inputs_ids(linearize([again.node])[1])
        assert walk.matches == count + 1
    assert walk.matcher is not None
    again = y * x + 1.0
    assert _inputs_ids(walk.match([again.node])) == _inputs_ids([y.node, x.node])
    assert walk.match([(x * y - 1.0).node]) is None


def test_fast_builders_set_every_slot_as_the_constructors_do(xy):
    """The operator and ``flame.op`` builders and the replays' ``wrap`` make nodes and tensors
    without calling ``Node.__init__`` and ``Tensor.__init__``: each slot must hold what those
    would put there (a slot never set raises AttributeError when read)."""
    from flame.ir.node import Node
    from flame.replay import wrap
    from flame.runtime.storage import Storage
    from flame.tensor import Tensor

    x, y = xy
    storage = Storage("reference", fl.float32, host=np.ones(4, dtype=np.float32))
    replayed = wrap(storage, fl.float32, (4,), ("model.py", 3))  # a compiled call's result
    built = [fl.exp(x), x * y, x * 2.0, 2.0 - x, x < y, replayed]
    for value in built:
        node = value.node
        expected = Node(node.op, node.inputs, node.attrs, node.dtype, node.shape, node.site)
        for slot in Node.__slots__:
            assert getattr(node, slot) == getattr(expected, slot), (node.op, slot)
        expected_tensor = Tensor(node, value.backend)
        for slot in Tensor.__slots__:
            if slot != "__weakref__":
                assert getattr(value, slot) is getattr(expected_tensor, slot), slot
        assert node == expected and hash(node) == hash(expected)


def _structure(node):
    """A node's graph as nested tuples: op, attrs, dtype, shape, site, inputs."""
    inputs = tuple(_structure(child) for child in node.inputs)
    return (node.op, node.attrs, node.dtype, node.shape, node.site, inputs)


def test_fast_paths_build_what_apply_builds(xy):
    """A 0-d operand of the same dtype (either side, reflected too), a subclass operand and a
    cast: the fast paths' nodes equal ``apply``'s, sites included."""
    from flame.nn import Parameter
    from flame.tensor import apply

    x, y = xy
    scale = fl.tensor(np.float32(2.5)).realize()
    weight = Parameter(fl.tensor(np.ones(4, dtype=np.float32)))
    cases = [
        (lambda: x * scale, lambda: apply("mul", x, scale)),
        (lambda: scale * x, lambda: apply("mul", scale, x)),
        (lambda: x - scale, lambda: apply("sub", x, scale)),
        (lambda: scale / x, lambda: apply("div", scale, x)),
        (lambda: x < scale, lambda: apply("lt", x, scale)),
        (lambda: weight * y, lambda: apply("mul", weight, y)),
        (lambda: y - weight, lambda: apply("sub", y, weight)),
        (lambda: weight * scale, lambda: apply("mul", weight, scale)),
        (lambda: x.to(fl.bfloat16), lambda: apply("cast", x, dtype=fl.bfloat16)),
    ]
    for fast, general in cases:
        built, expected = fast(), general()
        assert _structure(built.node) == _structure(expected.node)  # both at the case's line
        assert built.node.site[0] == __file__
        assert type(built) is fl.Tensor
    with fl.no_grad():
        assert (x * scale).node.op == "detach"
