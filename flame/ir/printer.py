"""The text form of a graph: short, typed, deterministic (names come from position)."""

from __future__ import annotations

from flame.ir.graph import Graph, is_input
from flame.ir.node import Node, format_site


def format_type(node: Node) -> str:
    return f"{node.dtype.short}[{','.join(str(size) for size in node.shape)}]"


def format_value(value) -> str:
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, tuple):
        return "[" + ",".join(format_value(item) for item in value) + "]"
    if hasattr(value, "name") and hasattr(value, "short"):
        return value.name
    return repr(value)


def node_names(graph: Graph) -> dict[int, str]:
    """``id(node) -> name`` as the printer spells it: inputs ``%0..``, then computed values
    in order; scalar constants are their value."""
    names: dict[int, str] = {}
    inputs = [node for node in graph.nodes if is_input(node)]
    for index, node in enumerate(inputs):
        names[id(node)] = f"%{index}"
    count = len(inputs)
    for node in graph.nodes:
        if is_input(node):
            continue
        if node.op == "const" and node.shape == ():  # printed inline, as its value
            value = format_value(node.attr("value"))  # ``~``: from sizes, a kernel argument
            names[id(node)] = f"~{value}" if node.attr("sized") else value
            continue
        names[id(node)] = f"%{count}"
        count += 1
    return names


def format_graph(graph: Graph, comment_width: int = 44) -> str:
    names = node_names(graph)
    params = [f"{names[id(node)]}: {format_type(node)}" for node in graph.nodes if is_input(node)]
    group_of = {}
    for index, group in enumerate(graph.groups or ()):
        for node in group.nodes:
            group_of[id(node)] = index
    lines = [f"graph {graph.name}({', '.join(params)}) {{"]
    for node in graph.nodes:
        if is_input(node) or (node.op == "const" and node.shape == ()):
            continue
        arguments = [names[id(child)] for child in node.inputs]
        arguments += [f"{key}={format_value(value)}" for key, value in node.attrs]
        text = f"  {names[id(node)]}: {format_type(node)} = {node.op}({', '.join(arguments)})"
        notes = []
        if id(node) in group_of:
            notes.append(f"k{group_of[id(node)]}")
        if node.site is not None:
            notes.append(format_site(node.site))
        if notes:
            text = text.ljust(comment_width) + "  # " + " ".join(notes)
        lines.append(text)
    lines.append(f"  return {', '.join(names[id(node)] for node in graph.outputs)}")
    lines.append("}")
    return "\n".join(lines)
