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
from flame.replay import direct_key, dispatcher
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
    direct = {direct_key((x, y)): "entry"}
    assert dispatcher(2)(direct, (x, y)) == "entry"
    # other tensors of the same key take the same program
    assert dispatcher(2)(direct, (_realized([5.0, 6.0]), y)) == "entry"


def _other_keys(x):
    """Calls whose key differs from ``(x, y)``'s in one part each (y: two float32s)."""
    with fl.backend("reference"):
        strided = fl.from_numpy(np.arange(4, dtype=np.float32)[::2])
    return {
        "arity": (x,),
        "not a tensor": (x, 2.0),
        "not realized": (x, x + 1),  # the general path realizes it
        "dtype": (x, _realized([3, 4], np.int32)),
        "shape": (x, _realized([3.0, 4.0, 5.0])),
        "layout": (x, strided),
    }


def test_dispatch_misses_what_the_key_does_not_cover(reference_backend):
    x, y = _realized([1.0, 2.0]), _realized([3.0, 4.0])
    direct = {direct_key((x, y)): "entry"}
    dispatch = dispatcher(2)
    for why, args in _other_keys(x).items():
        assert dispatch(direct, args) is None, why
    with use_deterministic_algorithms(True):
        assert dispatch(direct, (x, y)) is None  # another mode: other plans
    assert dispatch(direct, (x, y)) == "entry"


def test_dispatch_of_no_arguments(reference_backend):
    assert dispatcher(0)({direct_key(()): "entry"}, ()) == "entry"
    assert dispatcher(0)({}, ()) is None


@pytest.mark.gpu
def test_compiled_one_kernel_calls_take_the_direct_path(cuda_backend):
    @fl.compile
    def step(x, y):
        return (x * 2 + y).sigmoid()

    x = fl.tensor(np.linspace(-2, 2, 3000, dtype=np.float32)).realize()
    y = fl.tensor(np.linspace(1, 0, 3000, dtype=np.float32)).realize()
    expected = 1 / (1 + np.exp(-(x.numpy() * 2 + y.numpy())))
    np.testing.assert_allclose(step(x, y).numpy(), expected, rtol=1e-6)
    assert step._state._dispatch is not None and len(step._state._direct) == 1
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
    assert len(step._state._direct) == 2
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
    assert len(scale._state._direct) == 1
    seen = []
    with events.recording(lambda kind, data: seen.append(kind)):
        np.testing.assert_allclose(scale(x).numpy(), np.arange(512) * 3.0)
    assert "run" in seen  # the executor ran the plan and said so


def _launch_for_test():
    from flame.runtime.launch import Launch

    args = (("out", 2), ("in", 0), ("in", 1), _scalar(7, np.int32))
    function = SimpleNamespace(ptr=0xF00)
    return Launch(None, function, 3, 128, args, ((2, 0),), (((4,), np.float32),))


def _recorder(calls: list):
    import ctypes

    def launch_kernel(function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        # what the driver would read: the packed buffer the ``extra`` array points at
        pointers = (ctypes.c_void_p * 5).from_address(extra)
        size = ctypes.c_size_t.from_address(pointers[3]).value
        packed = ctypes.string_at(pointers[1], size)
        calls.append((function, gx, bx, stream, params, packed))

    return launch_kernel


def test_generated_and_plain_launches_pack_the_same_parameters(monkeypatch):
    import flame.runtime.launch as launch_module

    launch = _launch_for_test()
    arrays = [SimpleNamespace(data=SimpleNamespace(ptr=0x1000 * (i + 1))) for i in range(3)]
    plain, generated = [], []
    monkeypatch.setattr(launch_module, "_launch_kernel", _recorder(plain))
    launch.launch_into(list(arrays), stream=5)
    lines, names = launch.launch_source({0: "a", 1: "b", 2: "c"})
    names["launch_kernel"] = _recorder(generated)
    scope = dict(names)
    exec("def run(a, b, c, stream):\n" + "\n".join(lines) + "\n", scope)  # noqa: S102
    scope["run"](*arrays, 5)
    expected = struct.pack("=QQQi", 0x3000, 0x1000, 0x2000, 7)
    assert plain == generated == [(0xF00, 3, 128, 5, 0, expected)]
    assert len(launch._blocks) == 1  # the buffer went back to the pool after each launch


def test_a_generated_launch_raises_other_driver_errors_and_keeps_its_buffer():
    launch = _launch_for_test()
    lines, names = launch.launch_source({0: "a", 1: "b", 2: "c"})

    def failing(*arguments):
        raise RuntimeError("CUDA_ERROR_LAUNCH_FAILED")

    names["launch_kernel"] = failing
    scope = dict(names)
    exec("def run(a, b, c, stream):\n" + "\n".join(lines) + "\n", scope)  # noqa: S102
    arrays = [SimpleNamespace(data=SimpleNamespace(ptr=0x1000)) for _ in range(3)]
    with pytest.raises(RuntimeError, match="LAUNCH_FAILED"):
        scope["run"](*arrays, 0)
    assert len(launch._blocks) == 1
    assert launch.launch_source({0: "a", 1: "b"}) is None  # a slot it cannot name: no source


@pytest.mark.parametrize(("bound", "recycles"), [(None, True), (16, True), (15, False)])
def test_one_kernel_runners_are_generated_with_recycling_up_to_the_bound(bound, recycles):
    pytest.importorskip("cupy")
    from flame.runtime.direct import one_kernel_runner

    launch = _launch_for_test()  # one [4] float32 result: 16 bytes
    plan = SimpleNamespace(launches=(launch,), output_slots=(2,))
    header = ["def run(s0, s1):"]
    run = one_kernel_runner(plan, header, ["s0", "s1"], ["    return out"], {}, bound)
    compile(run.source, "<check>", "exec")
    assert ("recycled[0]" in run.source) is recycles
    assert "launch_pack(block[0], 0, out.data.ptr, x0.data.ptr, x1.data.ptr, 7)" in run.source
    # a plan of two launches, or whose launch writes another slot, gets no runner
    assert one_kernel_runner(SimpleNamespace(launches=(launch, launch), output_slots=(2,)),
                             header, ["s0", "s1"], [], {}) is None  # fmt: skip
    assert one_kernel_runner(SimpleNamespace(launches=(launch,), output_slots=(1,)),
                             header, ["s0", "s1"], [], {}) is None  # fmt: skip
