"""No global state: graphs, backends and caches of one thread or test never leak into another."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np

import flame as fl
from flame.codegen.elementwise import lower_elementwise
from flame.codegen.render import render
from flame.ir.graph import Graph
from flame.ir.passes import run_pipeline
from flame.runtime.cache import DiskCache
from flame.runtime.compiler import KernelCache
from flame.runtime.executor import _layout_of

ROOT = Path(__file__).resolve().parent.parent


def test_backend_choice_is_per_thread():
    seen = {}
    barrier = threading.Barrier(2)

    def worker(name):
        with fl.backend(name):
            barrier.wait()  # both threads are inside their own `with` at once
            seen[name] = fl.zeros(3).backend

    threads = [threading.Thread(target=worker, args=(name,)) for name in ("cuda", "reference")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen == {"cuda": "cuda", "reference": "reference"}


def test_two_threads_build_and_run_independent_graphs():
    results, errors = {}, []

    def worker(seed):
        try:
            with fl.backend("reference"):
                x = fl.from_numpy(np.full((64,), float(seed), np.float32))
                y = x
                for _ in range(200):
                    y = (y * 0.5 + x).tanh()
                text = str(Graph((y.node,)))  # before realizing: then y is one buffer
                results[seed] = (y.numpy(), text.count("tanh"))
        except Exception as error:  # reported below; a thread's exception is otherwise lost
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    for seed in (1, 2):
        expected = np.full((64,), float(seed), np.float32)
        value = expected.copy()
        for _ in range(200):
            value = np.tanh(value * 0.5 + expected)
        np.testing.assert_allclose(results[seed][0], value, rtol=1e-5)
        assert results[seed][1] == 200  # each graph holds only its own nodes


def test_printed_names_do_not_depend_on_what_was_built_before():
    def build():
        x = fl.from_numpy(np.ones(4, np.float32))
        return str(Graph(((x + 1.0).exp().node,)))

    first = build()
    for _ in range(50):  # unrelated graphs in between
        fl.from_numpy(np.ones(2, np.float32)).sin()
    assert build() == first


def test_kernel_cache_hit_from_a_fresh_process(tmp_path):
    x = fl.from_numpy(np.ones((32, 8), np.float32))
    graph = run_pipeline(Graph(((x * 2.0).cos().node,)))
    spec = lower_elementwise(graph.groups[0], _layout_of).spec
    source = render(spec)
    cache = KernelCache(DiskCache(tmp_path), arch="sm_90")
    _, cubin = cache.cubin(source, spec.name)
    assert cache.stats.compiles == 1
    (tmp_path / "kernel.cu").write_text(source)
    script = (
        "import json, sys; from pathlib import Path\n"
        "from flame.runtime.cache import DiskCache\n"
        "from flame.runtime.compiler import KernelCache\n"
        "cache = KernelCache(DiskCache(sys.argv[1]), arch='sm_90')\n"
        "_, cubin = cache.cubin(Path(sys.argv[1], 'kernel.cu').read_text(), sys.argv[2])\n"
        "print(json.dumps([cache.stats.compiles, cache.stats.disk_hits, len(cubin)]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path), spec.name],
        capture_output=True, text=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": ""},
        check=True,
    )  # fmt: skip
    assert json.loads(done.stdout) == [0, 1, len(cubin)]
