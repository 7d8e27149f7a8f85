"""A/B of lazy and compiled tiny20 host time between FLAME trees, in alternating processes.

    python3 notes/probes/ab_host.py ROUNDS TREE [TREE ...] > table

Each round starts one process per tree (order rotated each round); each process imports
torch first (its audit hooks are there in the bench's processes too), then times lazy tiny20
(build + realize) and compiled tiny20, best of 7 runs of 2000 calls, plus the bench's
pure-Python probe of the host's speed. Alternating processes put every tree on the same
host regimes; a difference smaller than the spread between rounds of one tree is noise.
"""

import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, time
try:
    import torch  # noqa: F401 (its audit hooks, as in the bench)
except ImportError:
    pass
sys.path.insert(0, sys.argv[1])
import flame as fl
from bench import expressions
from bench.timing import python_probe_us

def per_call(function, calls=2000, runs=7):
    for _ in range(200):
        function()
    fl.synchronize()
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(calls):
            function()
        fl.synchronize()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best

x = fl.randn(1024, seed=0).realize()
y = fl.randn(1024, seed=1).realize()
ops = expressions.flame_ops(fl)
compiled = fl.compile(expressions.bind(expressions.tiny20, ops))
row = {
    "probe": python_probe_us(),
    "lazy": per_call(lambda: expressions.tiny20(ops, x, y).realize()),
    "build": per_call(lambda: expressions.tiny20(ops, x, y)),
    "compiled": per_call(lambda: compiled(x, y)),
}
row["probe_after"] = python_probe_us()
print(json.dumps(row))
"""


def main() -> None:
    rounds, trees = int(sys.argv[1]), sys.argv[2:]
    bench_root = os.getcwd()
    rows = {tree: [] for tree in trees}
    for index in range(rounds):
        order = trees[index % len(trees) :] + trees[: index % len(trees)]
        for tree in order:
            environment = dict(os.environ, PYTHONPATH=bench_root)
            done = subprocess.run(
                [sys.executable, "-c", CHILD, os.path.abspath(tree)],
                env=environment,
                capture_output=True,
                text=True,
                timeout=300,
            )
            if done.returncode != 0:
                print(tree, "failed:", done.stderr[-1500:], file=sys.stderr)
                continue
            row = json.loads(done.stdout.strip().splitlines()[-1])
            rows[tree].append(row)
            print(index, tree, json.dumps(row), flush=True)
    print(f"{'tree':28s} {'lazy us':>18s} {'build us':>18s} {'compiled us':>18s} {'probe us':>14s}")
    for tree, samples in rows.items():
        if not samples:
            continue
        cells = []
        for key in ("lazy", "build", "compiled", "probe"):
            values = [sample[key] for sample in samples]
            cells.append(f"{min(values):6.2f}/{statistics.median(values):6.2f}")
        print(f"{tree:28s} " + " ".join(f"{cell:>18s}" for cell in cells))
    print("(min/median over rounds of each process's best of 7 x 2000 calls)")


if __name__ == "__main__":
    main()
