"""The per-call path of compiled one-kernel programs: the packed kernel parameters
(flame/runtime/launch.py) and the generated dispatch on the arguments' key (flame/replay.py).
The CPU tier checks the bytes packed and the dispatch's decisions; the GPU tier checks that
compiled calls take the direct path and stay right, with the dump listening too."""

from __future__ import annotations

import struct
from types import SimpleNamespace

import numpy as np
import pytest

import flame as fl
from flame.determinism import use_deterministic_algorithms
from flame.replay import MISS, direct_key, dispatcher
from flame.runtime.launch import _filler, param_codes, param_format


def _scalar(value, dtype):
    return ("scalar", np.dtype(dtype).type(value))


@pytest.mark.parametrize(
    ("args", "offsets", "size"),
    [
        ((("out", 0), ("in", 1), _scalar(7, np.int32)), [0, 8, 16], 20),
        ((_scalar(7, np.int32), ("in", 1)), [0, 8], 16),  # a pointer after an int32: padded
        ((_scalar(3, np.int32), _scalar(5, np.int64), _scalar(9, np.int32)), [0, 8, 16], 20),
        ((_scalar(3, np.int32), _scalar(4, np.int32), ("out", 0)), [0, 4, 8], 16),
    ],
)
def test_packed_parameters_sit_at_aligned_offsets(args, offsets, size):
    codes = param_codes(args)
    layout = struct.Struct(param_format(codes))
    assert layout.size == size
    pointers = {0: 0x7F0000001000, 1: 0x7F0000002000}
    slots = [SimpleNamespace(data=SimpleNamespace(ptr=pointers[i])) for i in range(2)]
    buffer = bytearray(b"\xff" * size)
    _filler(codes, tuple(int(value) for _, value in args))(buffer, slots)
    for (kind, value), offset in zip(args, offsets):
        if kind == "scalar":
            fmt = "=i" if value.dtype.itemsize == 4 else "=q"
            assert struct.unpack_from(fmt, buffer, offset)[0] == int(value)
        else:
            assert struct.unpack_from("=Q", buffer, offset)[0] == pointers[value]


def test_fillers_of_equal_values_and_other_widths_differ():
    # NumPy's int32 and int64 of one value compare equal; the cached filler must not mix them
    narrow = (("out", 0), _scalar(5, np.int32))
    wide = (("out", 0), _scalar(5, np.int64))
    assert param_codes(narrow) != param_codes(wide)
    assert struct.calcsize(param_format(param_codes(wide))) == 16
    assert struct.calcsize(param_format(param_codes(narrow))) == 12


def _realized(values, dtype=np.float32):
    with fl.backend("reference"):
        return fl.tensor(np.asarray(values, dtype=dtype)).realize()


def test_dispatch_finds_the_program_of_the_calls_key(reference_backend):
    x, y = _realized([1.0, 2.0]), _realized([3.0, 4.0])
    direct = {direct_key((x, y)): lambda s0, s1: ("ran", s0, s1)}
    result = dispatcher(2)(direct, (x, y))
    assert result[0] == "ran"
    assert result[1] is x.node.attr("storage") and result[2] is y.node.attr("storage")
    # other tensors of the same key take the same program
    assert dispatcher(2)(direct, (_realized([5.0, 6.0]), y))[0] == "ran"


def test_dispatch_misses_what_the_key_does_not_cover(reference_backend):
    x, y = _realized([1.0, 2.0]), _realized([3.0, 4.0])
    direct = {direct_key((x, y)): lambda s0, s1: "ran"}
    dispatch = dispatcher(2)
    assert dispatch(direct, (x,)) is MISS  # another number of arguments
    assert dispatch(direct, (x, 2.0)) is MISS  # not a tensor
    assert dispatch(direct, (x, y + 1)) is MISS  # not realized: the general path realizes it
    assert dispatch(direct, (x, _realized([3, 4], np.int32))) is MISS  # another dtype
    assert dispatch(direct, (x, _realized([3.0, 4.0, 5.0]))) is MISS  # another shape
    with fl.backend("reference"):
        strided = fl.from_numpy(np.arange(4, dtype=np.float32)[::2])
    assert dispatch(direct, (x, strided)) is MISS  # another layout
    with use_deterministic_algorithms(True):
        assert dispatch(direct, (x, y)) is MISS  # another mode: other plans
    assert dispatch(direct, (x, y)) == "ran"


def test_dispatch_of_no_arguments(reference_backend):
    assert dispatcher(0)({direct_key(()): lambda: "ran"}, ()) == "ran"
    assert dispatcher(0)({}, ()) is MISS


@pytest.mark.gpu
def test_compiled_one_kernel_calls_take_the_direct_path(cuda_backend):
    @fl.compile
    def step(x, y):
        return (x * 2 + y).sigmoid()

    x = fl.tensor(np.linspace(-2, 2, 3000, dtype=np.float32)).realize()
    y = fl.tensor(np.linspace(1, 0, 3000, dtype=np.float32)).realize()
    expected = 1 / (1 + np.exp(-(x.numpy() * 2 + y.numpy())))
    np.testing.assert_allclose(step(x, y).numpy(), expected, rtol=1e-6)
    assert step._dispatch is not None and len(step._direct) == 1
    for _ in range(3):
        np.testing.assert_allclose(step(x, y).numpy(), expected, rtol=1e-6)
    info = step.cache_info()
    assert (info.traces, info.hits) == (1, 3)
    # keyword arguments and a static value go the general path to the same program
    np.testing.assert_allclose(step(x, y=y).numpy(), expected, rtol=1e-6)
    assert step.cache_info().traces == 2  # keywords: a signature of their own
    shifted = fl.tensor(np.linspace(-2, 2, 1000, dtype=np.float32)).realize()
    shifted_y = fl.tensor(np.linspace(1, 0, 1000, dtype=np.float32)).realize()
    out = step(shifted, shifted_y)  # new sizes: re-planned, then direct again
    assert len(step._direct) == 2
    expected_small = 1 / (1 + np.exp(-(shifted.numpy() * 2 + shifted_y.numpy())))
    np.testing.assert_allclose(out.numpy(), expected_small, rtol=1e-6)


@pytest.mark.gpu
def test_direct_path_reads_closed_over_storage_and_reports_to_the_dump(cuda_backend):
    from flame.runtime import events

    weight = fl.tensor(np.full(512, 3.0, dtype=np.float32)).realize()

    @fl.compile
    def scale(x):
        return x * weight

    x = fl.tensor(np.arange(512, dtype=np.float32)).realize()
    np.testing.assert_allclose(scale(x).numpy(), np.arange(512) * 3.0)
    assert len(scale._direct) == 1
    seen = []
    with events.recording(lambda kind, data: seen.append(kind)):
        np.testing.assert_allclose(scale(x).numpy(), np.arange(512) * 3.0)
    assert "run" in seen  # the executor ran the plan and said so
