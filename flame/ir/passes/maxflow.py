"""Minimum s-t cut of a small directed graph (Edmonds-Karp: shortest augmenting paths).

The save-or-recompute pass (remat.py) cuts networks of a few hundred to a few thousand
edges. networkx has the same algorithm, but importing it costs 0.15-0.6 s in a new process
(measured on the H100 host: 0.61 s), which a warm start would pay before its first step; this
is the few lines the pass needs. tests/test_maxflow.py checks it against networkx on random
networks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable


def minimum_cut(
    edges: Iterable[tuple[Hashable, Hashable, int | None]], source: Hashable, sink: Hashable
) -> tuple[int, set]:
    """``(cut value, nodes on the source side)`` for edges ``(u, v, capacity)``; a capacity of
    None is infinite, and a repeated edge keeps its last capacity (as in a networkx DiGraph).
    Raises ValueError when only infinite edges separate the source from the sink."""
    index: dict[Hashable, int] = {}
    capacity: list[dict[int, int]] = []

    def node(name) -> int:
        if name not in index:
            index[name] = len(capacity)
            capacity.append({})
        return index[name]

    given: dict[tuple[int, int], int | None] = {}
    for u, v, cap in edges:
        given[(node(u), node(v))] = cap
    infinite = sum(cap for cap in given.values() if cap is not None) + 1
    for (a, b), cap in given.items():
        capacity[b].setdefault(a, 0)  # the reverse edge, for the residual graph
        capacity[a][b] = capacity[a].get(b, 0) + (infinite if cap is None else cap)
    s, t = node(source), node(sink)
    flow = 0
    while True:
        parent = _augmenting_path(capacity, s, t)
        if parent is None:
            break
        bottleneck, v = infinite, t
        while v != s:
            u = parent[v]
            bottleneck = min(bottleneck, capacity[u][v])
            v = u
        v = t
        while v != s:
            u = parent[v]
            capacity[u][v] -= bottleneck
            capacity[v][u] += bottleneck
            v = u
        flow += bottleneck
        if flow >= infinite:
            raise ValueError("minimum_cut: only infinite edges separate source and sink")
    side = _reachable(capacity, s)
    names = list(index)
    return flow, {names[i] for i in side}


def _augmenting_path(capacity, s: int, t: int) -> dict[int, int] | None:
    parent = {s: s}
    queue = deque([s])
    while queue:
        u = queue.popleft()
        for v, left in capacity[u].items():
            if left > 0 and v not in parent:
                parent[v] = u
                if v == t:
                    return parent
                queue.append(v)
    return None


def _reachable(capacity, s: int) -> set[int]:
    seen = {s}
    stack = [s]
    while stack:
        u = stack.pop()
        for v, left in capacity[u].items():
            if left > 0 and v not in seen:
                seen.add(v)
                stack.append(v)
    return seen
