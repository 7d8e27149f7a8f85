"""Breaking a dependency cycle between kernels in two (used by the fusion pass).

Fusion merges values of one shape and depth into one kernel; a merged kernel can then both
feed and wait for another kernel: a forward activation written for a matmul, merged with the
backward value that reads the matmul's result. Such a kernel splits into the values that
wait for no kernel depending on it (they run first) and the rest, instead of one kernel per
value.
"""

from __future__ import annotations

from flame.ir.graph import Group


def split_in_two(groups: list[Group], chosen: int, needs: list[set[int]], members) -> list | None:
    """The roots of ``groups[chosen]`` as ``[early, late]``: ``late`` roots read (themselves
    or through other late roots of the kernel) a value of a kernel that waits, directly or
    not, for this one. ``needs``: per kernel, the kernels it reads; ``members(root)``: what
    a kernel computing ``root`` computes. None when either part would be empty."""
    group = groups[chosen]
    waiting: set[int] = set()
    stack = [chosen]
    while stack:
        current = stack.pop()
        for index, sources in enumerate(needs):
            if current in sources and index not in waiting and index != chosen:
                waiting.add(index)
                stack.append(index)
    producer = {id(out): index for index, other in enumerate(groups) for out in other.outputs}
    own = {id(root) for root in group.outputs}
    reads: dict[int, set[int]] = {}
    for root in group.outputs:
        found = members(root)
        inside = {id(node) for node in found}
        reads[id(root)] = {
            id(child) for node in found for child in node.inputs if id(child) not in inside
        }
    late: set[int] = set()
    changed = True
    while changed:
        changed = False
        for root in group.outputs:
            if id(root) in late:
                continue
            for child in reads[id(root)]:
                if producer.get(child) in waiting or (child in own and child in late):
                    late.add(id(root))
                    changed = True
                    break
    early = [root for root in group.outputs if id(root) not in late]
    rest = [root for root in group.outputs if id(root) in late]
    return [early, rest] if early and rest else None
