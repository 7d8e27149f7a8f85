"""Breaking dependency cycles between kernels (used by the fusion pass): ``split_cycles``
splits kernels until none waits for another that waits for it, one kernel of each cycle a
round, in parts by levels or in two.

Fusion merges values of one shape and depth into one kernel; a merged kernel can then both
feed and wait for another kernel: a forward activation written for a matmul, merged with the
backward value that reads the matmul's result. Such a kernel splits into the values that
wait for no kernel depending on it (they run first) and the rest, instead of one kernel per
value.
"""

from __future__ import annotations

from flame.ir.graph import Group
from flame.ir.ops import get_op
from flame.ir.passes.library_views import materialized_reads


def cyclic_components(needs) -> list[set[int]]:
    """The kernels that wait for each other: the strongly connected components of more than
    one kernel of the graph ``kernel -> needs[kernel]`` (Tarjan's algorithm, without
    recursion: one pass over the kernels and their edges). ``needs``: a list (kernels are
    its indices) or a dict (its keys)."""
    kernels = needs.keys() if isinstance(needs, dict) else range(len(needs))
    index_of: dict[int, int] = {}
    low: dict[int, int] = {}
    on_stack: set[int] = set()
    stack: list[int] = []
    found: list[set[int]] = []
    for start in kernels:
        if start in index_of:
            continue
        work = [(start, iter(needs[start]))]
        index_of[start] = low[start] = len(index_of)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in index_of:
                    index_of[target] = low[target] = len(index_of)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(needs[target])))
                    break
                if target in on_stack and index_of[target] < low[node]:
                    low[node] = index_of[target]
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    if low[node] < low[parent]:
                        low[parent] = low[node]
                if low[node] == index_of[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(component)
    return found


def split_in_two(groups, chosen: int, readers, members, producer: dict | None = None):
    """The roots of ``groups[chosen]`` as ``[early, late]``: ``late`` roots read (themselves
    or through other late roots of the kernel) a value of a kernel that waits, directly or
    not, for this one. ``readers``: per kernel, the kernels that read it; ``members(root)``:
    what a kernel computing ``root`` computes; ``producer``: the kernel writing each value
    (by ``id``), when the caller keeps one. ``groups``, ``readers``: lists (kernels are
    indices) or dicts. None when either part would be empty."""
    group = groups[chosen]
    waiting: set[int] = set()
    stack = [chosen]
    while stack:
        current = stack.pop()
        for index in readers[current]:
            if index not in waiting and index != chosen:
                waiting.add(index)
                stack.append(index)
    if producer is None:
        producer = _producers(groups)
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


def split_by_levels(groups, chosen: int, needs, reads: dict, members, components=(), producer=None):
    """The roots of ``groups[chosen]`` in as many parts as the dependencies through other
    kernels need, all at once: each root's level is the largest number of times a path to
    it leaves this kernel for another one (a root, another kernel reading it, a root reading
    that, ...); roots of one level share a kernel. ``split_in_two`` done repeatedly peels
    one level a round (a deep model's backward merges a value of every layer into one
    kernel: one round per layer). ``reads``: per group (by id) the materialized values it
    reads; None when the kernels other than this one still wait for each other in a cycle
    (then ``split_in_two`` decides) or when one level would hold every root. ``components``:
    the kernels' cyclic components, when the caller has them: a cycle left among the other
    kernels is then found without building the graph of roots and kernels (same answer);
    ``producer``: as ``split_in_two``'s. ``groups``, ``needs``: lists or dicts, as there."""
    import graphlib

    for component in components:
        if chosen not in component or _still_cyclic(needs, component - {chosen}):
            return None
    group = groups[chosen]
    own = {id(root): root for root in group.outputs}
    if producer is None:
        producer = _producers(groups)
    graph: dict[tuple, set[tuple]] = {}  # node -> its predecessors
    for index, sources in needs.items() if isinstance(needs, dict) else enumerate(needs):
        if index == chosen:
            continue
        preds = graph.setdefault(("k", index), set())
        for source in sources:
            if source != chosen:
                preds.add(("k", source))
        if chosen in sources:
            preds.update(("r", key) for key in reads.get(id(groups[index]), ()) if key in own)
    for key, root in own.items():
        found = members(root)
        inside = {id(node) for node in found}
        preds = graph.setdefault(("r", key), set())
        for node in found:
            for child in node.inputs:
                if id(child) in inside:
                    continue
                if id(child) in own:
                    preds.add(("r", id(child)))
                elif producer.get(id(child)) not in (None, chosen):
                    preds.add(("k", producer[id(child)]))
    try:
        order = list(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError:
        return None
    level: dict[tuple, int] = {}
    for node in order:
        best = 0
        for pred in graph.get(node, ()):
            # leaving this kernel for another one and coming back costs a level
            step = 1 if pred[0] == "r" and node[0] == "k" else 0
            best = max(best, level.get(pred, 0) + step)
        level[node] = best
    parts: dict[int, list] = {}
    for root in group.outputs:
        parts.setdefault(level[("r", id(root))], []).append(root)
    if len(parts) < 2:
        return None
    return [parts[key] for key in sorted(parts)]


def _producers(groups) -> dict[int, int]:
    items = groups.items() if isinstance(groups, dict) else enumerate(groups)
    return {id(out): index for index, other in items for out in other.outputs}


def _still_cyclic(needs, kernels: set[int]) -> bool:
    """Whether some of ``kernels`` wait for each other in a cycle (over the edges of
    ``needs`` between them): a depth-first walk stops at the first edge back to a kernel on
    its path (a deep model's backward: soon), else it has seen them all."""
    done: set[int] = set()
    for start in kernels:
        if start in done:
            continue
        path = {start}
        work = [(start, iter(needs[start]))]
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in kernels or target in done or target == node:
                    continue
                if target in path:
                    return True
                path.add(target)
                work.append((target, iter(needs[target])))
                break
            else:
                work.pop()
                path.discard(node)
                done.add(node)
    return False


def split_cycles(groups, grouping, position, reasons, materialized, reads, alive) -> list[Group]:
    """Kernels split until none waits for another that waits for it. Every cycle between
    kernels is found at once (strongly connected components) and one kernel of each is split
    per round: the smallest that can be split (big row kernels stay whole), in as many parts
    as the levels of its values need (``split_by_levels``), else in two when its values
    split into those that wait for no kernel waiting for it and the rest (a forward value
    merged with the backward that needs a matmul of it, ``split_in_two``), else into one
    kernel per value. A deep model's backward has a few cycles per layer, and one cycle a
    round made fusion quadratic in the depth.

    Rounds only change the kernels they split and those that read them: each kernel has a
    number (``serial``) and a place in the order (``rank``: a split kernel's parts take its
    place, in their order), and the kernels each one waits for are kept from round to round
    (``needs``, ``readers``) instead of being found again for all of them. ``reads`` and
    ``alive``: as fuse.py's ``_needs``'s cache. ``grouping``: fuse.py's (its members and
    reduction keys of roots)."""
    producer: dict[int, int] = {}
    for serial, group in enumerate(groups):
        for out in group.outputs:
            producer[id(out)] = serial
    by_serial = dict(enumerate(groups))
    rank = {serial: (serial,) for serial in by_serial}
    needs: dict[int, set[int]] = {}
    readers: dict[int, set[int]] = {serial: set() for serial in by_serial}

    def waits_for(serial: int) -> set[int]:
        group = by_serial[serial]
        found = reads.get(id(group))
        if found is None:
            found = reads[id(group)] = materialized_reads(group, materialized)
        sources = {producer.get(key) for key in found}
        sources.discard(None)
        sources.discard(serial)
        return sources

    for serial in by_serial:
        needs[serial] = waits_for(serial)
        for source in needs[serial]:
            readers[source].add(serial)
    count = len(groups)
    for _ in range(len(groups) + 1):
        components = cyclic_components(needs)
        if not components:
            break
        split: dict[int, list] = {}
        for component in components:
            splittable = [i for i in component if len(by_serial[i].outputs) > 1]
            if splittable:
                chosen = min(splittable, key=lambda i: (len(by_serial[i].outputs), rank[i]))
                parts = split_by_levels(
                    by_serial, chosen, needs, reads, grouping.root_members, components, producer
                )
                if parts is None:
                    parts = split_in_two(
                        by_serial, chosen, readers, grouping.root_members, producer
                    )
                split[chosen] = parts or [[root] for root in by_serial[chosen].outputs]
        for chosen, parts in split.items():
            for source in needs.pop(chosen):
                readers[source].discard(chosen)
            waiting = readers.pop(chosen)
            base = rank.pop(chosen)
            del by_serial[chosen]
            made = []
            for place, roots in enumerate(parts):
                group = _part_group(roots, grouping, position, reasons)
                alive.append(group)
                by_serial[count], rank[count], readers[count] = group, base + (place,), set()
                for out in group.outputs:
                    producer[id(out)] = count
                made.append(count)
                count += 1
            for serial in made:
                needs[serial] = waits_for(serial)
                for source in needs[serial]:
                    readers[source].add(serial)
            for reader in waiting:  # what they read of ``chosen`` is now some part's
                found = waits_for(reader)
                for source in needs[reader] - found:
                    if source != chosen:
                        readers[source].discard(reader)
                for source in found - needs[reader]:
                    readers[source].add(reader)
                needs[reader] = found
    return [by_serial[serial] for serial in sorted(by_serial, key=rank.__getitem__)]


def _part_group(roots, grouping, position, reasons) -> Group:
    """The kernel of some of a split kernel's roots."""
    key = next(filter(None, map(grouping.reduction_key, roots)), None)
    found = sorted(grouping.members(roots, key), key=lambda n: position[id(n)])
    has_reduce = any(get_op(n.op).kind == "reduce" for n in found)
    if key is not None and not has_reduce:  # its reduction is another kernel's now
        found = sorted(grouping.members(roots, None), key=lambda n: position[id(n)])
    kind = "reduce" if has_reduce else "elementwise"
    why = tuple(reasons[id(root)] for root in roots)
    return Group(kind, tuple(found), tuple(roots), why)
