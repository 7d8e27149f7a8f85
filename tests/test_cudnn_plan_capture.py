"""A stored cuDNN plan is not deserialized under a stream capture (the frontend's deserialize
crashed warm processes there); the plan is built instead, and read from disk otherwise
(flame/runtime/library_cudnn.py)."""

from types import SimpleNamespace

import pytest

from flame.runtime import library_cudnn as dnn


class _Graph:
    def __init__(self, log):
        self.log = log

    def __getattr__(self, name):  # validate, build_operation_graph, ... : noted, no effect
        return lambda *args, **kwargs: self.log.append(name)

    def get_workspace_size(self):
        return 0

    def serialize(self):
        return b"plan"


@pytest.mark.parametrize("capturing", [False, True])
def test_a_stored_plan_is_built_again_under_a_capture(monkeypatch, capturing):
    log = []
    disk = {"key": b"stored"}
    fake = SimpleNamespace(heur_mode=SimpleNamespace(A="A", FALLBACK="FALLBACK"))
    monkeypatch.setattr(dnn, "_PLANS", {})
    monkeypatch.setattr(dnn, "_load", lambda: {"module": fake, "handle": 0})
    monkeypatch.setattr(dnn, "_disk_key", lambda key: "key")
    monkeypatch.setattr(dnn, "_disk", lambda: SimpleNamespace(get=disk.get, put=disk.__setitem__))
    monkeypatch.setattr(dnn, "_new_graph", lambda session, io_type: _Graph(log))
    monkeypatch.setattr(dnn, "_deserialize", lambda graph, handle, blob: log.append("deserialize"))
    monkeypatch.setattr(dnn, "_capturing", lambda: capturing)
    made = dnn.plan(("conv", "x"), "bfloat16", lambda graph: log.append("define"), lambda: "conv")
    if capturing:
        assert made.origin == "built" and "deserialize" not in log and "build_plans" in log
    else:
        assert made.origin == "disk" and log == ["deserialize"]
