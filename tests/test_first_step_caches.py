"""What makes the first compiled step from a warm disk cache cheap (issue 22), checked on the
CPU: launches whose parameters have the same kinds share one generated packer and still pack
their own values (flame/runtime/launch.py), the garbage collector is paused only while a
plan loads or a step is traced (``plan_store.paused_collector``), and the in-place write
checks find every plan input reading a written memory (flame/effects.py ``direct_writes``).
"""

from __future__ import annotations

import gc
import math
import struct
from types import SimpleNamespace

import numpy as np
import pytest

from flame.effects import direct_writes
from flame.ir import dtypes
from flame.ir.node import Node
from flame.runtime.launch import GENERATED_LIMIT, Launch, param_codes, param_format
from flame.runtime.plan_store import paused_collector


def _slots(count: int) -> list:
    """Stand-ins for the arrays of a plan's slots: slot i's address is 0x1000 * (i + 1)."""
    return [SimpleNamespace(data=SimpleNamespace(ptr=0x1000 * (i + 1))) for i in range(count)]


def _launch(args) -> Launch:
    return Launch(None, None, 1, 128, tuple(args), (), (), ())


def _packed(launch: Launch, slots: list) -> tuple:
    buffer = bytearray(launch._packer.size)
    launch._fill(buffer, slots)
    return struct.unpack_from(param_format(param_codes(launch.args)), buffer)


def test_launches_with_the_same_parameter_kinds_share_one_packer_and_pack_their_own_values():
    first = _launch([("out", 3), ("in", 0), ("scalar", np.int32(7)), ("scalar", np.float32(0.5))])
    second = _launch([("out", 1), ("in", 2), ("scalar", np.int32(-4)), ("scalar", np.float32(3))])
    other = _launch([("out", 3), ("in", 0), ("scalar", np.int64(7)), ("scalar", np.float32(0.5))])
    # one generated function per kind string: the launches' fillers are closures of it
    assert first._fill.__code__ is second._fill.__code__
    assert first._packer is second._packer
    assert other._fill.__code__ is not first._fill.__code__  # int64 is another layout
    slots = _slots(4)
    assert _packed(first, slots) == (0x4000, 0x1000, 7, 0.5)
    assert _packed(second, slots) == (0x2000, 0x3000, -4, 3.0)
    assert _packed(other, slots) == (0x4000, 0x1000, 7, 0.5)
    assert (first._packer.size, other._packer.size) == (24, 28)  # int64 at offset 16


def test_scalars_pack_exactly_as_struct_packs_them():
    value = np.float64(1 / 3)
    launch = _launch([
        ("scalar", np.float32(math.inf)), ("scalar", np.float32(math.nan)), ("scalar", value),
        ("scalar", np.float32(1 / 3)), ("scalar", np.int64(-(2**40))), ("in", 0),
    ])  # fmt: skip
    buffer = bytearray(launch._packer.size)
    launch._fill(buffer, _slots(1))
    expected = struct.pack(
        param_format(param_codes(launch.args)),
        math.inf, math.nan, float(value), float(np.float32(1 / 3)), -(2**40), 0x1000,
    )  # fmt: skip
    assert bytes(buffer) == expected


@pytest.mark.parametrize("count", [GENERATED_LIMIT - 3, GENERATED_LIMIT, 3 * GENERATED_LIMIT])
def test_long_parameter_lists_pack_their_own_values(count):
    # long lists of buffers (multi-output optimizer kernels) take the generic filler
    args = [("out" if i % 3 else "in", (7 * i) % count) for i in range(count)]
    first = _launch([*args, ("scalar", np.int32(count)), ("scalar", np.float32(0.25))])
    generic = count + 2 >= GENERATED_LIMIT
    assert ("_pointers_first" in first._fill.__qualname__) == generic
    shifted = [(kind, (slot + 1) % count) for kind, slot in args]
    second = _launch([*shifted, ("scalar", np.int32(-1)), ("scalar", np.float32(2))])
    slots = _slots(count)
    assert _packed(first, slots) == (*[0x1000 * (slot + 1) for _, slot in args], count, 0.25)
    assert _packed(second, slots) == (*[0x1000 * (s + 1) for _, s in shifted], -1, 2.0)
    mixed = _launch([("scalar", np.int64(5)), *args])  # a scalar first: generated code
    assert "_pointers_first" not in mixed._fill.__qualname__
    assert _packed(mixed, slots) == (5, *[0x1000 * (slot + 1) for _, slot in args])


def test_a_launch_without_parameters_packs_nothing():
    launch = _launch([])
    buffer = bytearray(1)
    launch._fill(buffer, [])
    assert launch._packer.size == 0 and buffer == bytearray(1)


def test_paused_collector_turns_the_collector_off_inside_and_back_on_after():
    was = gc.isenabled()
    gc.enable()
    try:
        with paused_collector():
            assert not gc.isenabled()
            with paused_collector():  # nested: the inner one leaves it off
                assert not gc.isenabled()
            assert not gc.isenabled()
        assert gc.isenabled()
        with pytest.raises(KeyError), paused_collector():
            raise KeyError("inside")
        assert gc.isenabled()  # on again after an error, too
        gc.disable()
        with paused_collector():
            assert not gc.isenabled()
        assert not gc.isenabled()  # off before: left off
    finally:
        (gc.enable if was else gc.disable)()


def _generation_of(value) -> int | None:
    for generation in range(3):
        if any(item is value for item in gc.get_objects(generation)):
            return generation
    return None


def test_what_a_paused_block_built_goes_to_the_oldest_generation_unscanned():
    was = gc.isenabled()
    gc.enable()
    try:
        with paused_collector():
            built = [[index] for index in range(1000)]  # containers the collector tracks
            assert _generation_of(built) == 0
        assert _generation_of(built) == 2 and gc.get_freeze_count() == 0
        # where the process froze objects itself, they stay frozen (counted by an object
        # held here: the freeze count alone also drops when frozen objects elsewhere die)
        kept = [[index] for index in range(10)]
        gc.freeze()
        frozen = gc.get_freeze_count()
        with paused_collector():
            young = [[1], [2]]
        assert _generation_of(kept) is None and _generation_of(young) == 0
        assert 0 < gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()
        (gc.enable if was else gc.disable)()


# -- the in-place write checks ---------------------------------------------------------------


def _memory(shape):
    """A write target's memory: a contiguous array of ``shape`` (a stand-in for CuPy's)."""
    flags = SimpleNamespace(c_contiguous=True)
    return SimpleNamespace(array=SimpleNamespace(flags=flags, shape=shape))


def _buffer(name: str, shape=(4,)) -> Node:
    return Node("buffer", (), (("storage", name),), dtypes.float32, shape)


def _checked(sources, targets, order, inputs, last_reader=None):
    """``direct_writes`` of a plan whose output i goes to slot 10 + i, written by launch 0,
    with ``targets`` (target, value) written in that order."""
    count = len(targets)
    plan = SimpleNamespace(
        output_slots=tuple(10 + i for i in range(count)),
        launches=[SimpleNamespace(zeroed=())],
        slot_steps=({10 + i: 0 for i in range(count)}, dict(last_reader or {})),
    )
    program = SimpleNamespace(
        sources=tuple(sources), plan=plan, flat=tuple(("out", i) for i in range(count)),
        writes=tuple((target, i) for i, (target, _) in enumerate(targets)),
    )  # fmt: skip
    writes = {}
    for target, value in targets:
        storage = target[1] if target[0] == "storage" else _memory(value.shape)
        writes[id(storage)] = [storage, value, []]
    return direct_writes(program, order, inputs, SimpleNamespace(writes=writes))


def test_direct_writes_find_every_plan_input_of_the_written_memory():
    first, second, third = _memory((4,)), _memory((4,)), _memory((4,))
    # slots: 0 the argument 0, 1 and 3 the same memory, 2 another, 4 a gradient held before
    inputs = [_buffer(f"in{i}") for i in range(5)]
    sources = [("arg", 0), ("storage", first), ("storage", second), ("storage", first),
               ("grad", 0)]  # fmt: skip
    # the write into ``first`` reads slot 1 elementwise; ``second`` is read by a reduction
    new_first = Node("add", (inputs[1], inputs[0]), (), dtypes.float32, (4,))
    total = Node("reduce_sum", (inputs[2],), (("axes", (0,)),), dtypes.float32, ())
    new_second = Node("mul", (inputs[2], inputs[4]), (), dtypes.float32, (4,))
    new_third = Node("neg", (inputs[0],), (), dtypes.float32, (4,))
    order = [*inputs, new_first, total, new_second, new_third]
    targets = [(("storage", first), new_first), (("storage", second), new_second),
               (("storage", third), new_third), (("arg", 0), new_third)]  # fmt: skip
    direct = _checked(sources, targets, order, inputs)
    # first: slots 1 and 3 are its memory, read only elementwise; second: read by a sum;
    # third: no input reads it; argument 0: read elementwise by add and neg
    assert direct == (10, None, 12, 13)
    # slot 3 reads ``first`` too: a reduction reading it, or a later step, forbids the write
    order_reduced = [*order, Node("reduce_sum", (inputs[3],), (), dtypes.float32, ())]
    assert _checked(sources, targets, order_reduced, inputs)[0] is None
    assert _checked(sources, targets, order, inputs, last_reader={3: 1})[0] is None
    assert _checked(sources, targets, order, inputs, last_reader={2: 1})[0] == 10
