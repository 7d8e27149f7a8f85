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
from flame.runtime.executor import linearize


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
