"""A CUDA-graph capture is not spoiled by FLAME's own background work, and a capture spoiled
from outside is tried again once (flame/replay.py, flame/runtime/warmup.py).

On the H100, the cuBLAS warm-up thread (started after a program's first launches) invalidated
the capture of a small compiled step that began while it ran: every such step then ran
launch by launch for good. Captures now wait for it; the GPU check is
tests/test_cudnn_plan_capture.py's fresh-process test (both processes capture)."""

import threading
import time
from types import SimpleNamespace

from flame.replay import GraphCache
from flame.runtime import warmup

SPOILED = "cudaErrorStreamCaptureInvalidated: operation failed due to a previous error"


def test_finish_waits_for_the_warm_up_thread(monkeypatch):
    done = threading.Event()

    def slow():
        time.sleep(0.2)
        done.set()

    thread = threading.Thread(target=slow, daemon=True)
    monkeypatch.setattr(warmup, "_thread", thread)
    thread.start()
    warmup.finish()
    assert done.is_set()


def test_finish_without_a_thread_returns(monkeypatch):
    monkeypatch.setattr(warmup, "_thread", None)
    warmup.finish()


class _Failing(GraphCache):
    """Captures that fail as a CUDA capture does: a step's own error (``own``) raised inside,
    then ending the capture raises the invalidation with that error as its context."""

    def __init__(self, errors, own=None):
        super().__init__(SimpleNamespace(), SimpleNamespace(graph_failures=[]))
        self.errors, self.own = list(errors), own

    def _capture(self, arrays, targets=None):
        try:
            if self.own is not None:
                raise RuntimeError(self.own)
        finally:
            raise RuntimeError(self.errors.pop(0))


ARRAYS = [SimpleNamespace(data=SimpleNamespace(ptr=4096))]


def test_a_spoiled_capture_is_tried_again_once():
    cache = _Failing([SPOILED, SPOILED])
    assert cache.run(ARRAYS, ()) is None and cache.failed is None  # run step by step, for now
    assert cache.run(ARRAYS, ()) is None and SPOILED in cache.failed  # twice: for good
    assert cache.run(ARRAYS, ()) is None and not cache.errors
    assert len(cache.info.graph_failures) == 2


def test_other_capture_failures_are_final():
    cache = _Failing(["cudaErrorStreamCaptureUnsupported: not permitted"])
    assert cache.run(ARRAYS, ()) is None and "Unsupported" in cache.failed


def test_a_capture_its_own_step_spoiled_is_final():
    """A step that synchronizes under the capture: the invalidation comes with the step's
    error as its context, and is not tried again."""
    cache = _Failing([SPOILED], own="cudaErrorStreamCaptureUnsupported: synchronize")
    assert cache.run(ARRAYS, ()) is None and SPOILED in cache.failed


def test_a_capture_spoiled_before_its_launches_is_tried_again():
    """Spoiled from outside mid-capture: its next launch fails as invalidated too."""
    cache = _Failing([SPOILED, SPOILED], own="launch: " + SPOILED)
    assert cache.run(ARRAYS, ()) is None and cache.failed is None
