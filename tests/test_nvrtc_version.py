"""NVRTC's version, read once per process, loaded in a background thread when the GPU executor
is first needed (flame/runtime/compiler.py: ``_NvrtcVersion``)."""

from __future__ import annotations

import threading

import pytest

from flame.runtime import compiler


def counting_reader(monkeypatch, result="12.8", gate: threading.Event | None = None):
    calls = []

    def read():
        calls.append(threading.current_thread().name)
        if gate is not None:
            assert gate.wait(10), "the test never opened the gate"
        if isinstance(result, Exception):
            raise result
        return result

    monkeypatch.setattr(compiler, "_read_nvrtc_version", read)
    return calls


def test_read_once_without_a_background_load(monkeypatch):
    calls = counting_reader(monkeypatch)
    version = compiler._NvrtcVersion()
    assert [version.get() for _ in range(3)] == ["12.8"] * 3
    assert calls == [threading.current_thread().name]


def test_get_waits_for_the_background_load_and_reads_nothing_itself(monkeypatch):
    gate = threading.Event()
    calls = counting_reader(monkeypatch, gate=gate)
    version = compiler._NvrtcVersion()
    version.start()
    version.start()  # a second start neither restarts nor reads again
    got = []
    waiter = threading.Thread(target=lambda: got.append(version.get()))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive(), "get returned before the background load finished"
    gate.set()
    waiter.join(10)
    assert got == ["12.8"]
    assert calls == ["flame-nvrtc"]
    assert version.get() == "12.8" and calls == ["flame-nvrtc"]


def test_a_failed_background_load_raises_in_the_callers_thread(monkeypatch):
    calls = counting_reader(monkeypatch, result=RuntimeError("no libnvrtc here"))
    version = compiler._NvrtcVersion()
    version.start()
    with pytest.raises(RuntimeError, match="no libnvrtc here"):
        version.get()
    assert calls == ["flame-nvrtc", threading.current_thread().name]
    monkeypatch.setattr(compiler, "_read_nvrtc_version", lambda: "13.0")
    assert version.get() == "13.0"  # nothing was kept from the failure


def test_the_process_version_matches_the_library():
    pytest.importorskip("cupy")
    try:
        expected = compiler._read_nvrtc_version()
    except Exception as error:  # no NVRTC wheel on this machine
        pytest.skip(f"NVRTC is not loadable here: {error}")
    compiler.load_nvrtc_in_background()
    assert compiler.nvrtc_version() == expected
