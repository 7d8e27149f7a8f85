"""A launch carries the dynamic shared memory its lowering asks for (a row held in shared
memory), and asks the driver for it above 48 KiB, once per function and size."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from flame.runtime import launch


def _launch(function, shared: int) -> launch.Launch:
    args = (("in", 0), ("out", 1), ("scalar", np.int32(7)))
    return launch.Launch(None, function, 4, 512, args, ((1, 0),), (((8,), np.float32),), (),
                         shared)  # fmt: skip


def test_above_48_kib_the_function_is_allowed_the_size_once(monkeypatch):
    from cupy_backends.cuda.api import driver

    calls = []
    monkeypatch.setattr(driver, "funcSetAttribute", lambda *a: calls.append(a))
    monkeypatch.setattr(launch, "_shared_allowed", {})
    function = SimpleNamespace(ptr=12345)
    _launch(function, 40 * 1024)
    assert calls == []  # the default limit covers it
    _launch(function, 96 * 1024)
    _launch(function, 96 * 1024)
    _launch(function, 64 * 1024)  # smaller than allowed: nothing to ask
    attribute = driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    assert calls == [(12345, attribute, 96 * 1024)]


def test_the_generated_launch_line_passes_the_shared_bytes():
    made = _launch(None, 0)
    object.__setattr__(made, "function", SimpleNamespace(ptr=1))
    object.__setattr__(made, "shared_bytes", 70000)
    lines, names = made.launch_source({0: "a", 1: "b"})
    assert "launch_shared," in "\n".join(lines) and names["launch_shared"] == 70000


def test_plan_from_a_lowering_takes_its_shared_bytes(monkeypatch):
    spec = SimpleNamespace(params=(), index_type="int", vec=1, block=512)
    lowered = SimpleNamespace(spec=spec, outputs=(), reads=(), grid_items=16, numel=0,
                              zeroed=(), threads=256, shared_bytes=2048)  # fmt: skip
    made = launch.Launch.plan(lowered, None, {})
    assert made.shared_bytes == 2048 and made.grid == 16 and made.block == 256
