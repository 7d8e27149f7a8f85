"""A compiled one-kernel program's ``entry`` (flame/replay.py ``one_kernel_replay``): the
whole fast path of a call in one generated function, tried first by the function
``flame.compile`` returns. The CPU tier runs it with CuPy's allocation, stream and driver
launch replaced by stand-ins: what it must take (the key, part by part), what it packs for
the driver, and the result it makes. The GPU tier checks the front function's choice of entry
when a compiled function alternates between programs."""

from __future__ import annotations

import ctypes
import itertools
import struct
from types import SimpleNamespace

import numpy as np
import pytest

import flame as fl
from flame.determinism import use_deterministic_algorithms
from flame.ir.node import Node
from flame.replay import MISS, direct_key, one_kernel_replay
from flame.runtime.storage import Storage
from flame.tensor import Tensor

pytest.importorskip("cupy")  # the runners bind CuPy's ndarray and stream getter


class _Array:
    """What a runner reads of a CuPy array."""

    itemsize, strides = 4, (4,)
    addresses = itertools.count(0x100000, 0x1000)  # each new array's own

    def __init__(self, shape=None, dtype=None, ptr=None):
        self.data = SimpleNamespace(ptr=ptr if ptr is not None else next(self.addresses))
        self.made_with = (shape, dtype)


def _cuda_tensor(ptr, shape=(4,), dtype=fl.float32):
    storage = Storage("cuda", dtype, _Array(ptr=ptr))
    return Tensor(Node("buffer", (), (("storage", storage),), dtype, shape, None), "cuda")


def _entry(key, launches: list):
    """An entry for a plan of one launch ``out = f(in0, in1, 7)`` over [4] float32, with the
    stand-ins bound in its namespace; ``launches`` records each driver call's packed bytes."""
    from flame.runtime.launch import Launch

    args = (("out", 2), ("in", 0), ("in", 1), ("scalar", np.int32(7)))
    launch = Launch(None, SimpleNamespace(ptr=0xF00), 3, 128, args, ((2, 0),),
                    (((4,), np.float32),))  # fmt: skip
    plan = SimpleNamespace(launches=(launch,), output_slots=(2,))
    output = (2, fl.float32, (4,), ("model.py", 9))
    sources = ((True, 0), (True, 1))
    run, entry = one_kernel_replay(plan, sources, output, None, 2, key)
    entry.run = run

    def launch_kernel(function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        pointers = (ctypes.c_void_p * 5).from_address(extra)
        size = ctypes.c_size_t.from_address(pointers[3]).value
        launches.append((function, gx, bx, stream, ctypes.string_at(pointers[1], size)))

    for function in (run, entry):
        function.__globals__.update(
            ndarray=_Array, current_stream=lambda: SimpleNamespace(ptr=0x5),
            launch_kernel=launch_kernel,
        )  # fmt: skip
    return entry


def test_the_entry_runs_its_key_and_makes_the_result_as_the_constructors_do():
    x, y = _cuda_tensor(0x1000), _cuda_tensor(0x2000)
    launches = []
    entry = _entry(direct_key((x, y)), launches)
    result = entry((x, y))
    out = result.node.attr("storage").array
    assert launches == [(0xF00, 3, 128, 0x5, struct.pack("=QQQi", out.data.ptr, 0x1000, 0x2000, 7))]
    assert out.made_with == ((4,), np.float32)
    # other tensors of the same key take it too; the kernel reads their memory
    entry((_cuda_tensor(0x3000), y))
    assert struct.unpack_from("=Q", launches[-1][-1], 8)[0] == 0x3000
    # the result: every slot of its Storage, Node and Tensor as the constructors set them
    storage = result.node.attr("storage")
    expected_storage = Storage("cuda", fl.float32, out)
    for slot in ("backend", "dtype", "array", "host", "_layout"):
        assert getattr(storage, slot) is getattr(expected_storage, slot), slot
    node = result.node
    expected = Node("buffer", (), (("storage", storage),), fl.float32, (4,), ("model.py", 9))
    for slot in Node.__slots__:
        assert getattr(node, slot) == getattr(expected, slot), slot
    for slot in ("node", "backend", "grad"):
        assert getattr(result, slot) == getattr(Tensor(node, "cuda"), slot), slot


def test_the_entry_returns_miss_for_any_other_key_and_launches_nothing():
    x, y = _cuda_tensor(0x1000), _cuda_tensor(0x2000)
    launches = []
    entry = _entry(direct_key((x, y)), launches)
    with fl.backend("reference"):
        strided = fl.from_numpy(np.arange(4, dtype=np.float32)[::2])
        on_reference = fl.tensor(np.ones(4, dtype=np.float32)).realize()
    others = {
        "arity": (x,),
        "not a tensor": (x, 2.0),
        "not realized": (x, Tensor(Node("exp", (y.node,), (), fl.float32, (4,), None), "cuda")),
        "dtype": (x, _cuda_tensor(0x2000, dtype=fl.float16)),
        "shape": (x, _cuda_tensor(0x2000, shape=(2, 2))),
        "alignment": (x, _cuda_tensor(0x2004)),
        "layout": (x, strided),
        "backend": (x, on_reference),
    }
    for why, args in others.items():
        assert entry(args) is MISS, why
    with use_deterministic_algorithms(True):
        assert entry((x, y)) is MISS  # another mode: other plans
    assert launches == []
    entry((x, y))
    assert len(launches) == 1


def test_the_front_function_tries_the_last_programs_entry_first(monkeypatch):
    """``flame.compile``'s function takes the entry of the last program called, else asks the
    state (which dispatches on the key and makes the program it found the one tried first)."""
    from flame.compile import CompiledFunction, _front
    from flame.replay import dispatcher

    state = CompiledFunction(lambda x, y: x + y)
    calls = []

    def entry_for(name, accepted):
        def entry(args):
            calls.append(name)
            return name if args[0] is accepted else MISS

        return entry

    a, b = _cuda_tensor(0x1000), _cuda_tensor(0x2000, shape=(8,))
    first, second = entry_for("first", a), entry_for("second", b)
    state._direct = {direct_key((a, a)): first, direct_key((b, b)): second}
    state._dispatch = dispatcher(2)
    state._entry = first
    compiled = _front(state)
    assert compiled(a, a) == "first" and calls == ["first"]
    assert compiled(b, b) == "second" and calls == ["first", "first", "second"]
    assert state._entry is second  # tried first from now on
    assert compiled(b, b) == "second" and calls[-1:] == ["second"] and len(calls) == 4
    assert compiled.cache_info().hits == 3


def test_run_and_entry_share_one_recycled_buffer():
    """A program's first call runs ``run`` (the trace's own replay), later ones ``entry``: a
    result dropped by one is recycled by the other, so a program keeps one buffer."""
    x, y = _cuda_tensor(0x1000), _cuda_tensor(0x2000)
    entry = _entry(direct_key((x, y)), [])
    first = entry.run(x.node.attr("storage"), y.node.attr("storage"))
    address = first.data_ptr()
    del first
    second = entry((x, y))
    assert second.data_ptr() == address
    third = entry((x, y))  # the second is still held: a new buffer
    assert third.data_ptr() != address


def test_an_entry_is_made_only_from_a_call_key():
    """The entry's constants come from ``direct_key``'s layout; any other tuple (a plan's
    key, say) is refused when the entry is made, not turned into a test that always misses."""
    x, y = _cuda_tensor(0x1000), _cuda_tensor(0x2000)
    key = direct_key((x, y))
    with pytest.raises(ValueError, match="not a direct_key of 2 tensors"):
        _entry(key[:-1], [])
    with pytest.raises(ValueError, match="not a direct_key"):
        _entry((*key[:4], "not a layout", *key[5:]), [])
