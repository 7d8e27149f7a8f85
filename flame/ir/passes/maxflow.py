"""Minimum s-t cut of a small directed graph (Dinic: shortest augmenting paths, by levels).

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
    # Dinic: a breadth-first pass labels the residual graph by distance from the source,
    # then paths along those levels are pushed until none is left, and again (the shortest
    # augmenting paths of Edmonds-Karp, many per pass instead of one pass each). The nodes
    # the source reaches in the residual graph of any maximum flow are the same set (the
    # smallest minimum cut), so the answer does not depend on which maximum flow is found.
    arcs = [list(targets) for targets in capacity]
    flow = 0
    while True:
        level = _levels(capacity, s, t)
        if level is None:
            break
        flow += _blocking_flow(capacity, arcs, level, s, t, infinite)
        if flow >= infinite:
            raise ValueError("minimum_cut: only infinite edges separate source and sink")
    side = _reachable(capacity, s)
    names = list(index)
    return flow, {names[i] for i in side}


def _levels(capacity, s: int, t: int) -> list[int] | None:
    """Each node's distance from ``s`` over edges with capacity left (-1: not reached);
    None when ``t`` is not reached."""
    level = [-1] * len(capacity)
    level[s] = 0
    queue = deque([s])
    while queue:
        u = queue.popleft()
        for v, left in capacity[u].items():
            if left > 0 and level[v] < 0:
                level[v] = level[u] + 1
                queue.append(v)
    return level if level[t] >= 0 else None


def _blocking_flow(capacity, arcs, level, s: int, t: int, infinite: int) -> int:
    """Pushes flow along paths whose every edge goes one level up until no such path from
    ``s`` to ``t`` has capacity left; returns the flow pushed."""
    following = [0] * len(capacity)  # per node: the first of its arcs not yet exhausted
    pushed = 0
    path = [s]
    while path:
        u = path[-1]
        if u == t:
            bottleneck = infinite
            for a, b in zip(path, path[1:]):
                bottleneck = min(bottleneck, capacity[a][b])
            for a, b in zip(path, path[1:]):
                capacity[a][b] -= bottleneck
                capacity[b][a] += bottleneck
            pushed += bottleneck
            path = [s]
            continue
        targets, edges, step = arcs[u], capacity[u], level[u] + 1
        while following[u] < len(targets):
            v = targets[following[u]]
            if edges[v] > 0 and level[v] == step:
                path.append(v)
                break
            following[u] += 1
        else:  # a dead end: nothing more goes through ``u`` in this pass
            level[u] = -1
            path.pop()
            if path:
                following[path[-1]] += 1
    return pushed


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
