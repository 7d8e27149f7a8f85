"""The minimum cut's source side does not depend on the max-flow algorithm: maxflow.py's
Dinic gives the save-or-recompute pass (remat.py) the same side as the Edmonds-Karp it
replaced (kept here as the reference), on random networks with ties and infinite edges."""

from __future__ import annotations

from collections import deque

import pytest

from flame.ir.passes.maxflow import minimum_cut


def _edmonds_karp(edges, source, sink):
    index, capacity = {}, []

    def node(name):
        if name not in index:
            index[name] = len(capacity)
            capacity.append({})
        return index[name]

    given = {}
    for u, v, cap in edges:
        given[(node(u), node(v))] = cap
    infinite = sum(cap for cap in given.values() if cap is not None) + 1
    for (a, b), cap in given.items():
        capacity[b].setdefault(a, 0)
        capacity[a][b] = capacity[a].get(b, 0) + (infinite if cap is None else cap)
    s, t = node(source), node(sink)
    flow = 0
    while True:
        parent, queue = {s: s}, deque([s])
        while queue and t not in parent:
            u = queue.popleft()
            for v, left in capacity[u].items():
                if left > 0 and v not in parent:
                    parent[v] = u
                    queue.append(v)
        if t not in parent:
            break
        bottleneck, v = infinite, t
        while v != s:
            bottleneck = min(bottleneck, capacity[parent[v]][v])
            v = parent[v]
        v = t
        while v != s:
            capacity[parent[v]][v] -= bottleneck
            capacity[v][parent[v]] += bottleneck
            v = parent[v]
        flow += bottleneck
        if flow >= infinite:
            raise ValueError("infinite")
    seen, stack = {s}, [s]
    while stack:
        u = stack.pop()
        for v, left in capacity[u].items():
            if left > 0 and v not in seen:
                seen.add(v)
                stack.append(v)
    names = list(index)
    return flow, {names[i] for i in seen}


@pytest.mark.parametrize("seed", range(200))
def test_same_side_as_edmonds_karp(seed):
    import numpy as np

    rng = np.random.default_rng(seed)
    nodes = int(rng.integers(3, 60))
    edges = []
    for _ in range(int(rng.integers(3, 400))):
        u, v = rng.integers(0, nodes, 2)
        if u != v:  # few distinct capacities: many cuts of equal value
            cap = None if rng.random() < 0.2 else int(rng.integers(0, 4))
            edges.append((int(u), int(v), cap))
    edges += [("s", 0, None), ("s", 1, None), (nodes - 1, "t", None), (nodes - 2, "t", None)]
    try:
        expected = _edmonds_karp(edges, "s", "t")
    except ValueError:
        with pytest.raises(ValueError, match="infinite"):
            minimum_cut(edges, "s", "t")
        return
    assert minimum_cut(edges, "s", "t") == expected
