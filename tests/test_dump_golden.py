"""Golden dumps: the passes, fusion groups and kernel sources of a few graphs, compared with
files under tests/golden/, so a change to passes or codegen shows what it did to the kernels.

Regenerate after an intended change with::

    FLAME_UPDATE_GOLDEN=1 PYTHONPATH=. python3 -m pytest -q tests/test_dump_golden.py

and read the diff (``git diff tests/golden``) before committing it. Line numbers of the
user's lines are replaced by ``N`` so editing this file does not churn the goldens.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest

import flame as fl
import flame.nn.functional as F
from flame.runtime import events
from flame.tools.dumpfiles import golden_text
from flame.tools.recorder import DumpRecorder

GOLDEN = Path(__file__).resolve().parent / "golden"


def _data(shape, seed):
    values = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return fl.from_numpy(values)


def elementwise_chain():
    x, y = _data((1024,), 0), _data((1024,), 1)
    a = fl.gelu(x * 1.5 + y, approximate="tanh") * fl.sigmoid(y)
    return [a - 0.5 * x * x + fl.tanh(x - y)]


def layer_norm():
    x, weight, bias = _data((64, 256), 0), _data((256,), 1), _data((256,), 2)
    return [F.layer_norm(x, (256,), weight, bias)]


def linear_gelu_softmax():
    x, w, b = _data((32, 64), 0), _data((64, 48), 1), _data((48,), 2)
    hidden = fl.gelu(fl.matmul(x, w) + b)
    return [F.softmax(hidden, -1), hidden.sum(0)]


GRAPHS = {"elementwise_chain": elementwise_chain, "layer_norm": layer_norm}
GRAPHS["linear_gelu_softmax"] = linear_gelu_softmax


def normalized(text: str) -> str:
    return re.sub(r"([\w.]+\.py):\d+", r"\1:N", text)


def dump_text(build) -> str:
    recorder = DumpRecorder()
    with fl.backend("reference"), events.recording(recorder):
        fl.realize(*build())
    assert len(recorder.graphs) == 1
    return normalized(golden_text(recorder.graphs[0]))


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_golden_dump(name, nvrtc):
    text = dump_text(GRAPHS[name])
    path = GOLDEN / f"dump_{name}.txt"
    if os.environ.get("FLAME_UPDATE_GOLDEN"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"{path} is missing: regenerate with FLAME_UPDATE_GOLDEN=1"
    expected = path.read_text()
    assert text == expected, (
        f"the dump of {name} changed; if intended, regenerate with FLAME_UPDATE_GOLDEN=1 "
        "and review `git diff tests/golden`"
    )


def test_golden_dumps_are_deterministic(nvrtc):
    assert dump_text(layer_norm) == dump_text(layer_norm)
