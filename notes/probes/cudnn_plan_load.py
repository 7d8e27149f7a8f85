"""What a cuDNN plan costs from FLAME's disk cache (issue 20's target: <= 5 ms a configuration).

Run twice with the same FLAME_CACHE_DIR: the first process builds the plans (conv forward,
data and weight gradients of UNet-shaped 3x3 convs, bf16 channels-last, and fused attention
forward + backward), the second reads them from disk. For every plan: its origin and ms; for
plans read from disk, the blob's size and the time split between ``list(blob)`` (the
frontend takes a list of ints), a fresh ``pygraph`` and ``deserialize`` alone. One JSON line.

    FLAME_CACHE_DIR=$(mktemp -d) sh -c 'python3 notes/probes/cudnn_plan_load.py;
                                        python3 notes/probes/cudnn_plan_load.py'
"""

from __future__ import annotations

import json
import time

import numpy as np

import flame as fl
import flame.nn.functional as F
from flame.runtime import library_cudnn


def workload(rng) -> None:
    for channels, size in ((128, 32), (256, 16), (256, 8)):
        x = fl.tensor(rng.standard_normal((8, channels, size, size)).astype(np.float32))
        w = fl.tensor(rng.standard_normal((channels, channels, 3, 3)).astype(np.float32) * 0.05)
        x, w = x.to(fl.bfloat16), w.to(fl.bfloat16)
        out, pullback = fl.vjp(lambda x, w: F.conv2d(x, w, padding=1), x, w)
        for grad in pullback(out):
            grad.realize()
    q, k, v = (
        fl.tensor(rng.standard_normal((8, 4, 256, 64)).astype(np.float32)).to(fl.bfloat16)
        for _ in range(3)
    )
    out, pullback = fl.vjp(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), q, k, v)
    for grad in pullback(out):
        grad.realize()
    fl.synchronize()


def split_disk_loads() -> list[dict]:
    session = library_cudnn._load()
    rows = []
    for made in list(library_cudnn._PLANS.values()):
        if made.origin != "disk":
            continue
        blob = library_cudnn._disk().get(library_cudnn._disk_key(made.key))
        started = time.perf_counter()
        values = list(blob)
        listed = time.perf_counter()
        graph = library_cudnn._new_graph(session, str(getattr(made.key[1], 'name', made.key[1])))
        fresh = time.perf_counter()
        graph.deserialize(session["handle"], values)
        done = time.perf_counter()
        rows.append({
            "op": str(made.key[0]), "bytes": len(blob), "ms_in_flame": round(made.ms, 2),
            "list_ms": round((listed - started) * 1e3, 2),
            "pygraph_ms": round((fresh - listed) * 1e3, 2),
            "deserialize_ms": round((done - fresh) * 1e3, 2),
        })  # fmt: skip
    return rows


def main() -> None:
    started = time.perf_counter()
    workload(np.random.default_rng(0))
    wall = time.perf_counter() - started
    times = library_cudnn.plan_times()
    print(json.dumps({
        "wall_s": round(wall, 2), "plans": library_cudnn.plan_counts(),
        "plan_ms": [(op, origin, round(ms, 2)) for op, origin, ms in times],
        "disk_split": split_disk_loads(),
    }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
