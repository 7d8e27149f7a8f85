"""A stored cuDNN plan is not deserialized under a stream capture (the frontend's deserialize
crashed warm processes there); the plan is built instead, and read from disk otherwise
(flame/runtime/library_cudnn.py)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from flame.runtime import library_cudnn as dnn

REPO = Path(__file__).resolve().parents[1]


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


CAPTURE_SCRIPT = textwrap.dedent(
    """
    import json
    import sys

    import numpy as np

    import flame as fl
    import flame.nn as nn
    import flame.nn.functional as F
    from flame.runtime import library_cudnn

    with fl.backend("cuda"):
        fl.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.SiLU(), nn.Conv2d(8, 3, 3))
        rng = np.random.default_rng(0)
        x = fl.tensor(rng.standard_normal((2, 3, 8, 8)).astype(np.float32))
        target = fl.tensor(rng.standard_normal((2, 3, 6, 6)).astype(np.float32))
        if sys.argv[1] == "step":  # sets .grad and updates in place: a step graph
            optimizer = fl.optim.SGD(model.parameters(), lr=0.1)

            @fl.compile(cuda_graph=True)
            def step(x, target):
                loss = F.mse_loss(model(x), target)
                loss.backward()
                optimizer.step()
                return loss

            losses = []
            for _ in range(3):
                model.zero_grad(set_to_none=True)
                losses.append(float(step(x, target).item()))
        else:  # returns its gradients: a program's graph (GraphCache)
            weights = [p.detach() for p in model.parameters()]

            def loss_of(x, target, *weights):  # no tensor from outside: the plan store's key
                hidden = F.conv2d(x, weights[0], weights[1], padding=1)
                hidden = F.silu(F.group_norm(hidden, 2))  # a graph big enough to be stored
                return F.mse_loss(F.conv2d(hidden, weights[2], weights[3]), target)

            gradients = fl.value_and_grad(loss_of, argnums=(2, 3, 4, 5))
            step = fl.compile(gradients, cuda_graph=True)
            losses = [float(step(x, target, *weights)[0].item()) for _ in range(3)]
        info = step.cache_info()
    print(json.dumps({"plans": library_cudnn.plan_counts(), "losses": losses,
                      "captures": info.graph_captures, "failures": info.graph_failures}))
    """
)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["step", "graph"])
def test_a_fresh_process_reads_a_captured_programs_plans_before_capturing(tmp_path, kind):
    """The second process finds the plans its capture needs on disk and reads them before
    the capture (none is built under it); both processes compute the same losses. (The list
    is kept under the plan store's key: programs too small for the store, under
    ``plan_store.MIN_NODES`` nodes, build their plans under the capture.)"""
    from flame.backends import cudnn

    if not cudnn.is_available():
        pytest.skip("cuDNN is not available")
    environment = {**os.environ, "FLAME_CACHE_DIR": str(tmp_path / "cache")}
    runs = []
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "-c", CAPTURE_SCRIPT, kind], env=environment, cwd=REPO,
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, second = runs
    for run in runs:
        assert run["captures"] == 1 and not run["failures"], run
    assert first["plans"].get("built", 0) >= 4, first  # forward and gradients of two convs
    assert second["plans"].get("disk", 0) >= 4 and not second["plans"].get("built"), second
    np.testing.assert_allclose(second["losses"], first["losses"], rtol=1e-6)
