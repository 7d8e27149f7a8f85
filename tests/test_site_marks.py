"""Recording each op's user line without rereading the frame's code object.

``frame.f_code`` is an audited read: every audit hook in the process runs on it. The graph
builders leave a ``SiteMark`` in the user frame's ``f_trace`` and read the code from it for
the next ops of that frame. These tests check that the mark saves the reads, never names
another frame's code, and never disturbs a tracer (debuggers, coverage).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

import flame as fl
from flame.ir.node import SiteMark

ROOT = Path(__file__).resolve().parent.parent


def _line() -> int:
    return sys._getframe(1).f_lineno


@pytest.fixture
def x(reference_backend):
    return fl.tensor(np.arange(4, dtype=np.float32)).realize()


def test_ops_of_one_frame_read_its_code_once():
    """Counted with an audit hook, in a child process: a hook cannot be removed again."""
    script = textwrap.dedent(
        """
        import sys
        import flame as fl
        reads = []
        sys.addaudithook(
            lambda event, args: reads.append(args[1] if event == "object.__getattr__" else event)
        )
        with fl.backend("reference"):
            x = fl.randn(8, seed=0).realize()

            def twenty(value):
                for _ in range(10):
                    value = value * 1.5
                    value = fl.tanh(value)
                return value

            twenty(x)  # the first call sets the mark in its frame
            before = reads.count("f_code")
            before_all = len(reads)
            result = twenty(x)
            after = reads[before_all:]
            print("F_CODE_READS", reads.count("f_code") - before, result.node.site[1] > 0,
                  after.count("sys._getframe"))
        """
    )
    environment = dict(os.environ, PYTHONPATH=str(ROOT))
    completed = subprocess.run(
        [sys.executable, "-c", script], env=environment, capture_output=True, text=True, timeout=120
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    line = next(line for line in completed.stdout.splitlines() if line.startswith("F_CODE_READS"))
    _, reads, has_site, getframes = line.split()
    assert int(reads) == 1  # 20 ops, one read: the new frame's first op
    assert has_site == "True"
    assert int(getframes) == 0  # the caller's frame comes from caller_frame, not sys._getframe


def test_marks_never_mix_frames_of_different_code(x):
    def first(value):
        return value * 2.0

    def second(value):
        return value * 2.0  # the same code offset as in ``first``

    lines = (first.__code__.co_firstlineno + 1, second.__code__.co_firstlineno + 1)
    for _ in range(3):  # frames come and go; a freed frame's memory may hold the next one
        assert first(x).node.site == (__file__, lines[0])
        assert second(x).node.site == (__file__, lines[1])


def test_the_mark_is_left_in_the_users_frame_only(x):
    x * 2.0
    assert type(sys._getframe().f_trace) is SiteMark
    value = fl.gelu(x)  # built inside FLAME's own code too, walking out to this line
    assert value.node.site == (__file__, _line() - 1)


def test_an_active_tracer_keeps_its_trace_function(x):
    seen = []

    def local(frame, event, arg):
        if event == "line":
            seen.append(frame.f_lineno)
        return local

    def tracer(frame, event, arg):
        return local if frame.f_code is traced.__code__ else None

    def traced(value):
        value = value * 2.0
        after = value + 1.0
        return after, sys._getframe().f_trace

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        result, trace_function = traced(x)
    finally:
        sys.settrace(previous)
    assert trace_function is local  # not replaced by a mark
    first = traced.__code__.co_firstlineno
    assert [first + 1, first + 2, first + 3] == seen  # every line after the op still traced
    assert result.node.site == (__file__, first + 2)


def test_a_tracer_started_after_the_mark_runs_the_frame_normally(x):
    x * 2.0  # leaves the mark in this frame
    assert type(sys._getframe().f_trace) is SiteMark
    events = []

    def tracer(frame, event, arg):
        events.append(event)
        return None

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        value = x + 1.0  # this frame's mark may be called for line events: it returns None
        here = _line() - 1
        total = float(value.numpy().sum())
    finally:
        sys.settrace(previous)
    assert value.node.site == (__file__, here)
    assert total == pytest.approx(10.0)
    assert "call" in events  # the tracer saw the new frames below this one


def test_threads_building_at_once_get_their_own_lines(x):
    """``caller_frame`` is one generator: a thread that finds another inside it takes
    ``sys._getframe`` instead. Either way each op gets its own thread's line."""

    def left(value):
        return value * 2.0

    def right(value):
        return fl.tanh(value)

    lines = {left: left.__code__.co_firstlineno + 1, right: right.__code__.co_firstlineno + 1}
    wrong, errors = [], []
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible

    def run(function):
        try:
            for _ in range(3000):
                site = function(x).node.site
                if site != (__file__, lines[function]):
                    wrong.append(site)
        except Exception as error:  # reported below: a thread's exception is not raised here
            errors.append(error)

    threads = [threading.Thread(target=run, args=(f,)) for f in (left, right) * 3]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(switch)
    assert not errors
    assert not wrong


def test_a_frame_site_without_a_frame_is_none():
    from flame.ir.node import frame_site

    assert frame_site(None) is None


def test_a_closed_caller_frame_falls_back_to_getframe(x, monkeypatch):
    """After ``caller_frame`` is closed (interpreter shutdown), ops still get their lines."""
    from flame import fast_paths

    def closed(_):
        raise StopIteration

    # the builders bind ``caller_frame`` when made: make fresh ones over the closed one
    monkeypatch.setattr(fast_paths, "caller_frame", closed)
    multiply = fast_paths._fast_binary("mul")
    hyperbolic = fast_paths._fast_unary("tanh")
    here = _line()
    assert multiply(x, x).node.site == (__file__, here + 1)
    assert hyperbolic(x).node.site == (__file__, here + 2)


def _flame_module(source: str) -> dict:
    """``source`` run as if it were a module of FLAME (its frames count as FLAME's own)."""
    from flame.ir.node import FLAME_DIR

    namespace: dict = {}
    exec(
        compile(textwrap.dedent(source), os.path.join(FLAME_DIR, "_test_held.py"), "exec"),
        namespace,
    )
    return namespace


def test_ops_built_deep_in_flame_get_the_line_that_called_in(x):
    """The walk out of FLAME leaves the site in a running FLAME frame (``HeldSite``): later
    ops of that frame, and of frames it calls, stop there, and a new call from another line
    gets that line."""
    module = _flame_module(
        """
        import flame as fl

        def rule(value):
            return fl.tanh(value) * 2.0

        def loop(value, count):
            return [rule(value) for _ in range(count)]

        def outer(value, count):
            return loop(value, count)
        """
    )
    first, line = module["outer"](x, 4), _line()
    second, other = module["outer"](x, 3), _line()
    assert {t.node.site for t in first} == {(__file__, line)}
    assert {t.node.site for t in second} == {(__file__, other)}
    assert {t.node.inputs[0].site for t in first} == {(__file__, line)}  # the tanh's


def test_a_flame_generator_never_holds_a_site(x):
    """A generator's caller changes from one resumption to the next: each op gets the line
    that resumed it."""
    module = _flame_module(
        """
        import flame as fl

        def build(value):
            return fl.tanh(value)

        def steps(value):
            while True:
                yield build(value)
        """
    )
    steps = module["steps"](x)
    first, line = next(steps), _line()
    second, other = next(steps), _line()
    assert first.node.site == (__file__, line)
    assert second.node.site == (__file__, other)
