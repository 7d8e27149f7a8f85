"""Walking a lazy graph for the executor: ``linearize`` (nodes inputs-first, the inputs, and
the structural key that finds a cached plan) and lazy mode's recorded walks (``record_walk``,
``match_walk``: a graph built again at the same line is checked against the last one instead
of walked again).
"""

from __future__ import annotations

from flame.ir.node import Node, Token, attrs_key


def linearize(outputs) -> tuple[list[Node], list[Node], tuple]:
    """The graph behind ``outputs`` in one pass: nodes inputs-first, its inputs, and its
    structure as a flat tuple (computed nodes by op/attrs/type/input positions, inputs by
    type and memory layout only) that keys the plan cache.

    This runs on every realize of lazy mode, so it is the interpreter's fast path: a
    recursive depth-first walk (Python calls are cheaper than an explicit stack of markers);
    a graph deeper than the recursion limit is walked again with an explicit stack, in the
    same order, giving the same key."""
    position: dict[int, int] = {}
    order: list[Node] = []
    inputs: list[Node] = []
    parts: list[tuple] = []
    get = position.get

    def visit(node: Node) -> int:
        if node.buffer is not None or node.op == "buffer":
            storage = node.buffer or node.attr("storage")
            part = (node.dtype, node.shape, storage.layout())
            inputs.append(node)
        else:
            # an op node's dtype and shape follow from its op, attrs and inputs; a
            # generated leaf (constant, random numbers) needs them spelled out
            children = node.inputs
            count = len(children)
            if count == 2:
                first, second = children
                a = get(id(first))
                if a is None:
                    a = visit(first)
                b = get(id(second))
                if b is None:
                    b = visit(second)
                part = (node.op, node.attrs and attrs_key(node.attrs), a, b)
            elif count == 1:
                first = children[0]
                a = get(id(first))
                if a is None:
                    a = visit(first)
                part = (node.op, node.attrs and attrs_key(node.attrs), a)
            elif count == 0:
                part = (node.op, attrs_key(node.attrs), node.dtype, node.shape)
            else:
                indices = []
                for child in children:
                    index = get(id(child))
                    indices.append(visit(child) if index is None else index)
                part = (node.op, node.attrs and attrs_key(node.attrs), *indices)
        index = len(order)
        position[id(node)] = index
        order.append(node)
        parts.append(part)
        return index

    try:
        roots = [visit(root) if get(id(root)) is None else position[id(root)] for root in outputs]
    except RecursionError:
        position.clear()
        order.clear()
        inputs.clear()
        parts.clear()
        stack = list(reversed(outputs))
        done = object()  # marks "children visited" for the node below it on the stack
        while stack:
            node = stack.pop()
            if node is done:
                node = stack.pop()
                if id(node) in position:
                    continue
                if node.buffer is not None or node.op == "buffer":
                    storage = node.buffer or node.attr("storage")
                    parts.append((node.dtype, node.shape, storage.layout()))
                    inputs.append(node)
                elif node.inputs:
                    children = [position[id(child)] for child in node.inputs]
                    parts.append((node.op, node.attrs and attrs_key(node.attrs), *children))
                else:
                    parts.append((node.op, attrs_key(node.attrs), node.dtype, node.shape))
                position[id(node)] = len(order)
                order.append(node)
                continue
            if id(node) in position:
                continue
            stack.append(node)
            stack.append(done)
            if node.buffer is None and node.op != "buffer":
                for child in reversed(node.inputs):
                    if id(child) not in position:
                        stack.append(child)
        roots = [position[id(root)] for root in outputs]
    parts.append(tuple(roots))
    return order, inputs, tuple(parts)


def record_walk(order: list[Node], key: tuple) -> tuple | None:
    """A graph's walk, kept so that the next graph built the same way is checked against it
    instead of walked again (``match_walk``): per node, root first, (None, (dtype, shape,
    layout)) for an input, (False, (op, attrs, dtype, shape)) for an op without inputs, and
    (op, attrs, *input positions) otherwise -- ``linearize``'s key, positions counted from
    the root. None for a graph with a ``Token`` (a recomputation, unique to its graph: the
    next graph's would never match)."""
    count = len(order)
    entries = []
    for node, part in zip(order, key):
        if node.buffer is not None or node.op == "buffer":
            entries.append((None, part))
            continue
        for _, value in node.attrs:
            if type(value) is Token:
                return None
        if not node.inputs:
            entries.append((False, part))
        else:
            entries.append((node.op, part[1], *(count - 1 - index for index in part[2:])))
    entries.reverse()
    return tuple(entries)


def match_walk(entries: tuple, root, positions: tuple | None = None) -> list[Node] | None:
    """The graph behind ``root`` checked against a recorded walk: its inputs in
    ``linearize``'s order when ``linearize`` would give the recorded key (the same ops,
    attributes and sharing; inputs of the same type and layout), else None.

    Lazy mode's fast path: a loop that builds the same expression every step pays one
    pass of identity and equality checks per node, not the walk with its position table.
    The nodes are visited root first; each op node places its inputs at their recorded
    positions, and an input already placed there must be the same object. Several roots
    (``root`` a list): ``positions`` says where the walk recorded each (a root reached
    from another root, too, must be the node placed there)."""
    nodes = [None] * len(entries)
    if positions is None:
        nodes[0] = root
    else:
        if len(root) != len(positions):
            return None
        for node, index in zip(root, positions):
            if nodes[index] is not None:
                return None  # two roots recorded at one position: never from linearize
            nodes[index] = node
    inputs = []
    for node, entry in zip(nodes, entries):  # ``nodes`` is filled ahead of the loop
        op = entry[0]
        if op is None:
            storage = node.buffer
            if storage is None:
                if node.op != "buffer":
                    return None
                storage = node.attr("storage")
            if (node.dtype, node.shape, storage.layout()) != entry[1]:
                return None
            inputs.append(node)
            continue
        if node.buffer is not None:
            return None
        if op is False:
            if node.inputs or (node.op, attrs_key(node.attrs), node.dtype, node.shape) != entry[1]:
                return None
            continue
        if node.op != op or (node.attrs and attrs_key(node.attrs)) != entry[1]:
            return None
        children = node.inputs
        count = len(children)
        if len(entry) != count + 2:
            return None
        if count == 2:
            first, second = children
            placed = nodes[entry[2]]
            if placed is None:
                nodes[entry[2]] = first
            elif placed is not first:
                return None
            placed = nodes[entry[3]]
            if placed is None:
                nodes[entry[3]] = second
            elif placed is not second:
                return None
        elif count == 1:
            index, child = entry[2], children[0]
            placed = nodes[index]
            if placed is None:
                nodes[index] = child
            elif placed is not child:
                return None
        else:
            for child, index in zip(children, entry[2:]):
                placed = nodes[index]
                if placed is None:
                    nodes[index] = child
                elif placed is not child:
                    return None
    inputs.reverse()
    if len(inputs) > 1 and len({id(node) for node in inputs}) != len(inputs):
        # One input at two recorded positions: the graph shares more than the recorded one,
        # whose plan would compute the work over it twice (``exp(x) + exp(x)`` after
        # ``exp(x) + exp(y)``): it is walked anew and gets a plan and a walk of its own.
        return None
    return inputs


COMPILED_WALK_LIMIT = 1024  # entries (compiling costs ~45 us each on the CPU machine)
COMPILE_AFTER = 8  # matches by the loop before a walk's matcher is compiled


class RecordedWalk:
    """One line's recorded walk (``record_walk``), the plan it ran, and where its roots
    were: matched by ``match_walk`` until it has matched ``COMPILE_AFTER`` times (a line
    that keeps being built the same way), then by the matcher ``compile_walk`` makes."""

    __slots__ = ("entries", "plan", "positions", "matches", "matcher")

    def __init__(self, entries: tuple, plan, positions: tuple):
        self.entries = entries
        self.plan = plan
        self.positions = positions
        self.matches = 0
        self.matcher = None

    def match(self, roots: list) -> list[Node] | None:
        """``match_walk(self.entries, roots, self.positions)``."""
        matcher = self.matcher
        if matcher is not None:
            return matcher(roots)
        inputs = match_walk(self.entries, roots, self.positions)
        if inputs is not None:
            self.matches += 1
            if self.matches == COMPILE_AFTER:  # threads racing here compile it twice at worst
                self.matcher = compile_walk(self.entries, self.positions)
        return inputs


def compile_walk(entries: tuple, positions: tuple | None = None):
    """``match_walk`` for one recorded walk, as straight-line Python generated from it:
    ``matcher(root)`` (``root`` a list when ``positions`` is given) returns what
    ``match_walk(entries, root, positions)`` returns.

    The loop of ``match_walk`` interprets the record at every node (entry lookups, the
    position table, branches on the entry's kind); the generated function has each check
    spelled out with the node in a local variable, which costs about a third as much. Lazy
    mode compiles the walk of a line that keeps being built the same way. None where the
    record cannot be compiled (too long, roots at repeated positions)."""
    if len(entries) > COMPILED_WALK_LIMIT:
        return None
    constants: dict[str, object] = {}
    placed: set[int] = set()
    if positions is None:
        lines = ["def matcher(n0):"]
        placed.add(0)
    else:
        if len(set(positions)) != len(positions):
            return None
        roots = "".join(f"n{index}, " for index in positions)
        lines = [
            "def matcher(roots):",
            f"    if len(roots) != {len(positions)}: return None",
            f"    {roots}= roots",
        ]
        placed.update(positions)
    inputs = []
    for index, entry in enumerate(entries):
        if index not in placed:
            return None  # a node no earlier one reaches: never from record_walk
        node, op = f"n{index}", entry[0]
        constants[f"k{index}"] = entry[1]
        if op is None:
            inputs.append(node)
            lines += [
                f"    s = {node}.buffer",
                "    if s is None:",
                f"        if {node}.op != 'buffer': return None",
                f"        s = {node}.attr('storage')",
                f"    if ({node}.dtype, {node}.shape, s.layout()) != k{index}: return None",
            ]
            continue
        lines.append(f"    if {node}.buffer is not None: return None")
        if op is False:
            lines.append(
                f"    if {node}.inputs or ({node}.op, attrs_key({node}.attrs), {node}.dtype,"
                f" {node}.shape) != k{index}: return None"
            )
            continue
        constants[f"o{index}"] = op
        children = entry[2:]
        lines += [
            f"    a = {node}.attrs",
            f"    if {node}.op != o{index} or (a and attrs_key(a)) != k{index}: return None",
            f"    c = {node}.inputs",
            f"    if len(c) != {len(children)}: return None",
        ]
        for place, child in enumerate(children):
            if child in placed:
                lines.append(f"    if c[{place}] is not n{child}: return None")
            else:
                lines.append(f"    n{child} = c[{place}]")
                placed.add(child)
    # one input at two recorded positions: more sharing than recorded (see ``match_walk``)
    if len(inputs) == 2:
        lines.append(f"    if {inputs[0]} is {inputs[1]}: return None")
    elif len(inputs) > 2:
        lines.append(f"    if len({{{', '.join(f'id({n})' for n in inputs)}}}) != {len(inputs)}:")
        lines.append("        return None")
    lines.append(f"    return [{', '.join(reversed(inputs))}]")
    namespace = dict(constants, attrs_key=attrs_key)
    exec(compile("\n".join(lines), "<flame recorded walk>", "exec"), namespace)  # noqa: S102
    return namespace["matcher"]
