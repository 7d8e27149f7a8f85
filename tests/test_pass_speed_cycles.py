"""The fusion pass's cycle helpers (flame/ir/passes/cycles.py), rewritten for speed, against
plain reachability on random graphs: the cyclic components (from a list or a dict of
needs) and whether a subset of kernels still holds a cycle."""

from __future__ import annotations

import pytest

from flame.ir.passes.cycles import _still_cyclic, cyclic_components


def _reach(needs, start, allowed):
    seen, stack = set(), [start]
    while stack:
        node = stack.pop()
        for target in needs[node]:
            if target in allowed and target not in seen:
                seen.add(target)
                stack.append(target)
    return seen


def _random_needs(seed):
    import numpy as np

    rng = np.random.default_rng(seed)
    count = int(rng.integers(1, 40))
    density = float(rng.random()) * 0.15
    return [
        {int(j) for j in range(count) if j != i and rng.random() < density} for i in range(count)
    ]


@pytest.mark.parametrize("seed", range(100))
def test_components_are_the_mutually_reachable_sets(seed):
    needs = _random_needs(seed)
    everything = set(range(len(needs)))
    reach = [_reach(needs, i, everything) for i in range(len(needs))]
    expected = set()
    for i in range(len(needs)):
        component = frozenset({i} | {j for j in reach[i] if i in reach[j]})
        if len(component) > 1:
            expected.add(component)
    assert {frozenset(c) for c in cyclic_components(needs)} == expected
    keyed = {100 + i: {100 + j for j in sources} for i, sources in enumerate(needs)}
    found = {frozenset(c) for c in cyclic_components(keyed)}
    assert found == {frozenset(100 + i for i in c) for c in expected}


@pytest.mark.parametrize("seed", range(100))
def test_still_cyclic_is_a_cycle_within_the_subset(seed):
    import numpy as np

    needs = _random_needs(seed)
    rng = np.random.default_rng(seed + 1000)
    subset = {i for i in range(len(needs)) if rng.random() < 0.7}
    expected = any(i in _reach(needs, i, subset) for i in subset)
    assert _still_cyclic(needs, subset) == expected
