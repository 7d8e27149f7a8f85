"""Backward graphs rebuilt from a template when the forward graph repeats.

Building a backward graph runs every op's backward rule in Python: about 20 µs per forward
node, ten times the cost of building the forward node. A training loop in lazy mode builds
the same forward graph every step, so its backward is the same graph over new leaves. The
first time ``cotangents`` runs for a call site, it records:

- the forward graph walked breadth-first from the outputs and seeds: per node its op,
  attributes, dtype, shape and the positions of its inputs (leaves holding data: dtype and
  shape only, never their memory);
- the nodes the backward rules made, in order: op, attributes, type, site, and where each
  input comes from (a forward position or an earlier made node);
- where each target sits, and which node is its gradient.

The next call at that site walks its forward graph against the record (same ops and
attributes, the same sharing, node for node) and, when it matches, makes the recorded nodes
over the new forward nodes: the same graph the rules would have built, without running them.
Anything the record cannot stand for is never recorded and always runs the rules: hooks
(user code), checkpoints (they call the user's function), and backward nodes that hold data.

The templates are a memo of pure structure keyed by the user's line, the deterministic mode
and whether gradients are enabled; equal keys and equal graphs give equal answers, so threads
and tests can share them.
"""

from __future__ import annotations

from flame.ir.node import Node

TEMPLATE_SITES = 256  # call sites whose last templates are kept
TEMPLATES_PER_SITE = 4
RECORDS_PER_SITE = 16  # a site whose graphs keep changing stops being recorded
MAX_NODES = 20_000  # larger graphs are not recorded (the record would cost more than it saves)

_templates: dict[tuple, tuple] = {}  # key -> ((template, ...) newest first, records made)


class _NoTemplate(Exception):
    """This graph cannot be recorded."""


def _forward_walk(roots: list[Node]) -> tuple[list[Node], list[tuple]]:
    """Breadth-first from ``roots``: the nodes by position, and one entry per position."""
    nodes = list(roots)
    position = {}
    for index, node in enumerate(roots):
        if id(node) in position:
            raise _NoTemplate  # a root given twice: keep to the rules
        position[id(node)] = index
    entries = []
    for node in nodes:  # ``nodes`` grows while it is walked
        if len(nodes) > MAX_NODES:
            raise _NoTemplate
        info = node.grad_info
        if info is not None and info.hooks:
            raise _NoTemplate
        op = node.op
        if op == "checkpoint":
            raise _NoTemplate
        if op == "buffer":
            entries.append((op, None, node.dtype, node.shape, ()))
            continue
        children = []
        if op != "detach":  # the backward never looks behind a detach
            for child in node.inputs:
                index = position.get(id(child))
                if index is None:
                    index = position[id(child)] = len(nodes)
                    nodes.append(child)
                children.append(index)
        entries.append((op, node.attrs, node.dtype, node.shape, tuple(children)))
    return nodes, entries


def _match(entries: list[tuple], roots: list[Node]) -> list[Node] | None:
    """The forward nodes by position when the graph behind ``roots`` is the recorded one
    (same ops, attributes, types and sharing), else None."""
    count = len(entries)
    nodes = [None] * count
    nodes[: len(roots)] = roots
    # ``nodes`` is filled ahead of the loop: each position was recorded as an input of an
    # earlier one, which places it
    for node, entry in zip(nodes, entries):
        op, attrs, dtype, shape, children = entry
        if node.op != op or node.dtype is not dtype or node.shape != shape:
            return None
        info = node.grad_info
        if info is not None and info.hooks:
            return None
        if attrs is None:  # a leaf holding data: any memory of this type
            continue
        if node.attrs != attrs:
            return None
        if op == "detach":
            continue
        inputs = node.inputs
        if len(inputs) != len(children):
            return None
        for child, index in zip(inputs, children):
            placed = nodes[index]
            if placed is None:
                nodes[index] = child
            elif placed is not child:
                return None
    if len({id(node) for node in nodes}) != count:
        return None  # more sharing than recorded: a node stands at two positions
    return nodes


def record(roots: list[Node], targets: list[Node], grads: list[Node | None]) -> tuple | None:
    """The template of one backward: ``grads[i]`` is the gradient node of ``targets[i]``
    that the rules built (None: no gradient). None when this backward cannot be recorded."""
    try:
        nodes, entries = _forward_walk(roots)
    except _NoTemplate:
        return None
    position = {id(node): index for index, node in enumerate(nodes)}
    target_positions = []
    for target in targets:
        index = position.get(id(target))
        if index is None:
            return None  # a target outside the graph: its gradient is None, every time
        target_positions.append(index)
    made: dict[int, int] = {}  # id(new node) -> instruction index
    instructions = []
    stack = [(node, False) for node in grads if node is not None and id(node) not in position]
    while stack:  # post-order over the new nodes, stopping at forward ones
        node, expanded = stack.pop()
        if id(node) in made:
            continue
        if not expanded:
            stack.append((node, True))
            for child in reversed(node.inputs):
                if id(child) not in position and id(child) not in made:
                    stack.append((child, False))
            continue
        if node.op in ("buffer", "checkpoint") or node.grad_info is not None:
            return None  # holds data or user code: never shared between calls
        refs = tuple(
            position[id(child)] if id(child) in position else ~made[id(child)]
            for child in node.inputs
        )  # fmt: skip
        made[id(node)] = len(instructions)
        instructions.append((node.op, node.attrs, node.dtype, node.shape, node.site, refs))
        if len(instructions) > MAX_NODES:
            return None
    results = tuple(
        None if node is None else position[id(node)] if id(node) in position else ~made[id(node)]
        for node in grads
    )  # fmt: skip
    return entries, len(roots), tuple(target_positions), tuple(instructions), results


def replay(template: tuple, roots: list[Node], targets: list[Node]) -> list[Node | None] | None:
    """The gradient nodes of ``targets`` made from ``template`` over this forward graph;
    None when the graph is not the recorded one."""
    entries, root_count, target_positions, instructions, results = template
    if len(roots) != root_count or len(targets) != len(target_positions):
        return None
    nodes = _match(entries, roots)
    if nodes is None:
        return None
    for target, index in zip(targets, target_positions):
        if nodes[index] is not target:
            return None
    made = []
    append = made.append
    for op, attrs, dtype, shape, site, refs in instructions:
        inputs = tuple([nodes[ref] if ref >= 0 else made[~ref] for ref in refs])
        append(Node(op, inputs, attrs, dtype, shape, site))
    return [
        None if ref is None else nodes[ref] if ref >= 0 else made[~ref] for ref in results
    ]  # fmt: skip


def lookup(key: tuple, roots: list[Node], targets: list[Node]) -> list[Node | None] | None:
    for template in _templates.get(key, ((), 0))[0]:
        grads = replay(template, roots, targets)
        if grads is not None:
            return grads
    return None


def worth_recording(key: tuple) -> bool:
    return _templates.get(key, ((), 0))[1] < RECORDS_PER_SITE


def remember(key: tuple, template: tuple | None) -> None:
    """Keep ``template`` (None: count a graph that could not be recorded)."""
    kept, records = _templates.get(key, ((), 0))
    if key not in _templates and len(_templates) >= TEMPLATE_SITES:
        _templates.pop(next(iter(_templates)), None)
    if template is not None:
        kept = (template, *kept[: TEMPLATES_PER_SITE - 1])
    _templates[key] = (kept, records + 1)
