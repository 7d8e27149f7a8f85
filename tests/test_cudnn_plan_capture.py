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
    binds = []
    monkeypatch.setattr(dnn, "_bind_stream", lambda session: binds.append(capturing))
    made = dnn.plan(("conv", "x"), "bfloat16", lambda graph: log.append("define"), lambda: "conv")
    if capturing:
        assert made.origin == "built" and "deserialize" not in log and "build_plans" in log
    else:
        assert made.origin == "disk" and log == ["deserialize"]
    # bound to the caller's stream before a read or a build, except under a capture: the
    # stream it was bound to last may have been a capture's, destroyed since
    assert binds == ([] if capturing else [False])


class _Session:
    """A fake cuDNN session over a dict disk: plans built or read, capturing switched by the
    test (``plan`` builds under a capture; ``preload`` reads outside)."""

    def __init__(self, monkeypatch):
        from flame.runtime import plan_store

        self.log, self.disk, self.capturing = [], {}, False
        fake = SimpleNamespace(heur_mode=SimpleNamespace(A="A", FALLBACK="FALLBACK"))
        monkeypatch.setattr(dnn, "_PLANS", {})
        monkeypatch.setattr(dnn, "_load", lambda: {"module": fake, "handle": 0})
        monkeypatch.setattr(dnn, "usable", lambda: True)
        monkeypatch.setattr(dnn, "_disk_key", lambda key: ("plan", key))
        monkeypatch.setattr(
            dnn, "_disk", lambda: SimpleNamespace(get=self.disk.get, put=self.disk.__setitem__)
        )
        monkeypatch.setattr(dnn, "_new_graph", lambda session, io_type: _Graph(self.log))
        monkeypatch.setattr(
            dnn, "_deserialize", lambda graph, handle, blob: self.log.append(("read", blob))
        )
        monkeypatch.setattr(dnn, "_capturing", lambda: self.capturing)
        monkeypatch.setattr(dnn, "_bind_stream", lambda session: self.log.append("bind"))
        monkeypatch.setattr(dnn, "_SESSION", {"module": fake})
        monkeypatch.setattr(plan_store, "enabled", lambda: True)

    def new_process(self, monkeypatch):
        monkeypatch.setattr(dnn, "_PLANS", {})
        self.log.clear()

    def capture(self, keys, digest="digest", fail=False):
        """``plan`` of each key under a capture inside ``plans_for_capture``: the origins."""
        with dnn.plans_for_capture(digest):
            self.capturing = True
            try:
                made = [dnn.plan(key, io, lambda graph: None, lambda: "op") for key, io in keys]
                if fail:
                    raise RuntimeError("capture failed")
            finally:
                self.capturing = False
        return [plan.origin for plan in made]


KEYS = [
    (("fprop", "bfloat16", ((64, 128, 32, 32), (131072, 1, 4096, 128)), "{'pad': [1, 1]}"),
     "bfloat16"),
    (("sdpa", "bfloat16", 0.125, False, (0, (64, 6, 256, 64), (98304, 64, 384, 1))), "bfloat16"),
]  # fmt: skip


def test_stored_plans_of_a_capture_are_read_before_the_next_capture(monkeypatch):
    session = _Session(monkeypatch)
    assert session.capture(KEYS) == ["built", "built"]  # a first process: nothing stored
    stored = dnn.decode_entries(session.disk[dnn._list_key("digest")])
    assert stored == KEYS
    session.new_process(monkeypatch)
    assert session.capture(KEYS) == ["disk", "disk"]  # read before the capture, not built
    assert "build_plans" not in session.log
    assert session.log[0] == "bind" and session.log[-1] == "bind"  # before reads, after capture
    assert [entry for entry in session.log if entry[0] == "read"] == [("read", b"plan")] * 2


def test_a_capture_without_a_digest_or_that_fails_stores_no_list(monkeypatch):
    session = _Session(monkeypatch)
    session.capture(KEYS, digest=None)
    with pytest.raises(RuntimeError, match="capture failed"):
        session.capture(KEYS[:1], digest="other", fail=True)
    assert not any(isinstance(key, str) for key in session.disk)  # plans only, no lists


def test_a_list_grows_with_plans_a_later_capture_asks_for(monkeypatch):
    session = _Session(monkeypatch)
    session.capture(KEYS[:1])
    session.new_process(monkeypatch)
    assert session.capture(KEYS) == ["disk", "built"]
    assert dnn.decode_entries(session.disk[dnn._list_key("digest")]) == KEYS


@pytest.mark.parametrize("data", [None, b"", b"not python", b"[1, 2]", b"[[('k',), 3]]", b"\xff"])
def test_malformed_lists_read_as_empty(data):
    assert dnn.decode_entries(data) == []


def test_lists_round_trip_floats_and_nested_tuples():
    entries = [(("sdpa", "float16", 0.08838834764831845, True, ((1, 2), (3, 4)), None), "half")]
    assert dnn.decode_entries(dnn.encode_entries(entries)) == entries
