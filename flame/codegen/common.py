"""What every kernel lowering shares: the reads of a group (each a base value seen through a
strided view), storage conversions, C expressions of ops, literals and the comment header."""

from __future__ import annotations

import functools
import re

from flame.codegen.doubles import Float64Unsupported, double_helper, double_text
from flame.codegen.spec import c_literal
from flame.ir import dtypes
from flame.ir.graph import Group, is_input
from flame.ir.node import Node, format_site
from flame.ir.ops import HELPERS, get_op
from flame.ir.printer import format_type, format_value
from flame.ir.views import MOVEMENT_OPS, View, resolve
from flame.records import Record

INDEX_LEAVES = ("rand", "randn", "arange")


class Read(Record):
    """A value a kernel reads: ``base`` (a buffer, or a leaf generated from its index)
    through ``view``; ``top`` is the node consumers refer to (the last movement op)."""

    top: Node
    base: Node
    view: View
    generated: bool
    aligned: bool = True
    param: str = ""
    strides: tuple[int, ...] = ()  # over the collapsed iteration space
    offset: int = 0


def is_scalar_const(node: Node) -> bool:
    return node.op == "const" and node.shape == ()


def collect_reads(group: Group, layout_of) -> tuple[list[Read], dict[int, Node]]:
    """The reads of a group, and the internal values that consumers see through views
    (``aliases``: top node -> member it stands for, e.g. a broadcast per-row reduction)."""
    members = {id(node) for node in group.nodes}
    reads: dict[int, Read] = {}
    aliases: dict[int, Node] = {}

    def base_view(node):
        if is_input(node) or id(node) not in members:
            strides, _ = layout_of(node)
            return View(tuple(node.shape), tuple(strides), 0)
        return View.contiguous(node.shape)

    def visit(top: Node) -> None:
        if id(top) in reads or id(top) in aliases or is_scalar_const(top):
            return
        if id(top) in members and top.op not in MOVEMENT_OPS and top.op not in INDEX_LEAVES:
            return  # computed in the kernel
        base, view = resolve(top, base_view, lambda m: id(m) in members)
        if id(base) in members and base.op not in INDEX_LEAVES:
            aliases[id(top)] = base
            return
        generated = base.op in INDEX_LEAVES and id(base) in members
        aligned = True if generated else layout_of(base)[1]
        reads[id(top)] = Read(top, base, view, generated, aligned)

    for node in group.nodes:
        if node.op in MOVEMENT_OPS:
            continue
        for child in node.inputs:
            visit(child)
    for root in group.outputs:
        visit(root)
    return list(reads.values()), aliases


def load(dtype: dtypes.DType, expression: str) -> str:
    if dtype is dtypes.float16:
        return f"flame_load_f16({expression})"
    if dtype is dtypes.bfloat16:
        return f"flame_load_bf16({expression})"
    return expression


def store(dtype: dtypes.DType, expression: str) -> str:
    if dtype is dtypes.float16:
        return f"flame_store_f16({expression})"
    if dtype is dtypes.bfloat16:
        return f"flame_store_bf16({expression})"
    return expression


def cast_expression(source: dtypes.DType, target: dtypes.DType, value: str) -> str:
    if target.is_bool:
        return value if source.is_bool else f"({value} != 0)"
    if target.is_float:
        exact = source.is_float and source.c_compute == target.c_compute
        converted = value if exact else f"({target.c_compute}){value}"
        if target in (dtypes.float16, dtypes.bfloat16):
            converted = load(target, store(target, converted))
        return converted
    return f"({target.c_compute}){value}"


def attr_literal(value, dtype: dtypes.DType = dtypes.float32) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, (int, float)):
        return "0"  # not a number (a token, a dtype): never spelled in an expression
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    return c_literal(value, dtype if dtype.is_float else dtypes.float32)


def computes_double(node: Node) -> bool:
    """Whether ``node``'s float arithmetic runs in double: its result or a float input
    (a comparison of float64 values) is float64."""
    if node.dtype is dtypes.float64:
        return True
    return any(child.dtype is dtypes.float64 for child in node.inputs)


class Helpers:
    """C helper functions a kernel needs, each once, in first-use order."""

    def __init__(self):
        self.sources: list[str] = []

    def need(self, names, used_in: str | None = None) -> None:
        """Add the helpers ``names`` (in their order); with ``used_in``, only those that
        text calls, directly or through another of them (an op lists the helpers of all
        its expressions)."""
        if used_in is not None:
            names = _called(names, used_in)
        for name in names:
            self._add(HELPERS[name])

    def need_double(self, names, used_in: str) -> None:
        """``need`` for code written for float that ``used_in`` (that code, before its
        rewrite for double) calls: the helpers' double forms (flame/codegen/doubles.py)."""
        for name in _called(names, used_in):
            self._add(double_helper(name))

    def _add(self, source: str) -> None:
        if source not in self.sources:
            self.sources.append(source)


def _called(names, text: str) -> list[str]:
    """The helpers among ``names`` whose functions ``text`` calls, or the called ones do."""
    called: set[str] = set()
    pending = [text]
    while pending:
        code = pending.pop()
        calls = set(re.findall(r"\b(\w+)\s*\(", code))
        for name in names:
            defined = _defined(name)
            if name not in called and (calls & defined or not defined):  # none found: keep
                called.add(name)
                pending.append(HELPERS[name])
    return [name for name in names if name in called]


@functools.cache
def _defined(helper: str) -> frozenset:
    """The functions a helper's source defines (a helper may define several: flame_minmax
    defines flame_max and flame_min, for float and as templates)."""
    return frozenset(re.findall(r"__device__[^(;{]*?\b(\w+)\s*\(", HELPERS[helper]))


def op_expression(node: Node, arguments: list[str], helpers: Helpers) -> str:
    """The C expression of an elementwise node over its arguments' C expressions."""
    if node.op == "cast":
        return cast_expression(node.inputs[0].dtype, node.dtype, arguments[0])
    op = get_op(node.op)
    category = node.inputs[-1].dtype.category
    double = category == 2 and computes_double(node)
    literal_type = dtypes.float64 if double else dtypes.float32
    literals = {key: attr_literal(value, literal_type) for key, value in node.attrs}
    narrow = node.dtype in (dtypes.float16, dtypes.bfloat16)
    text = op.expression(category, narrow).format(*arguments, **literals)
    if not double:
        helpers.need(op.helpers, used_in=text)
        return text
    helpers.need_double(op.helpers, used_in=text)
    try:
        return double_text(text, node.op)
    except Float64Unsupported as error:
        raise Float64Unsupported(f"{node.op}: {error}") from None


def generated_expression(node: Node, index: str, helpers: Helpers) -> str:
    """The value of a generated leaf (rand, randn, arange) at linear ``index``."""
    op = get_op(node.op)
    helpers.need(op.helpers)
    category = node.dtype.category if node.op == "arange" else 2
    literals = {key: c_literal(value, node.dtype) for key, value in node.attrs if key != "seed"}
    text = op.expression(category).format(index=index, seed=node.attr("seed", 0), **literals)
    if category == 2 and node.op == "arange" and node.dtype is dtypes.float64:
        return double_text(text, node.op)  # random numbers keep float32 resolution
    if category == 2:
        return cast_expression(dtypes.float32, node.dtype, text)
    return text


def const_literal(node: Node) -> str:
    return c_literal(node.attr("value"), node.dtype)


class SizeArgs(dict):
    """The constants of a kernel that are its arguments, not literals (node id -> ``Arg``):
    those derived from sizes (``sized``: the 1/n of a mean), and ``counters``: integer
    constants added into a random draw's counter (``counter_constants``). ``index``: the
    kernel's index type, which an integer argument is passed as."""

    def __init__(self, group: Group | None = None, index: str = "int"):
        super().__init__()
        self.counters = counter_constants(group) if group is not None else frozenset()
        self.index = index


COUNTER_PATH_OPS = frozenset(("add", "sub", "expand", "reshape", "broadcast_to"))
_INT32_MAX = 2**31 - 1


def counter_constants(group: Group) -> frozenset:
    """Ids of the integer constants a group adds into a ``philox`` counter. In a compiled
    step each draw's counters start at its place among the step's draws (flame/random.py:
    ``state offset + local``), a number that follows the sizes of every draw before it
    (the batch, the image): as a literal it made the UNet step's dropout and noise kernels
    new code at every new resolution or batch size (44 of 47 compiles). A counter's value
    never changes the code that hashes it, so these constants are arguments."""
    found: set = set()
    stack = [node.inputs[1] for node in group.nodes if node.op == "philox"]
    seen: set = set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if node.op == "const":
            if node.dtype.is_int:
                found.add(id(node))
        elif node.op in COUNTER_PATH_OPS:
            stack.extend(node.inputs)
    return frozenset(found)


def const_text(node: Node, size_args: dict) -> str:
    """A constant's C text: its literal, or, for a constant derived from sizes (``sized``: 1/n
    of a mean) or a draw's counter offset (``SizeArgs.counters``), the kernel argument that
    carries it, added to ``size_args`` (node id -> Arg) once: a new size changes the
    argument, not the code."""
    counter = id(node) in getattr(size_args, "counters", ())
    if not (node.attr("sized") or counter):
        return const_literal(node)
    arg = size_args.get(id(node))
    if arg is None:
        from flame.codegen.spec import Arg

        name = f"sized{len(size_args)}"
        value = node.attr("value")
        if not counter:
            arg = Arg("value", node.dtype.c_compute, name, value)
        elif size_args.index == "int" and not -_INT32_MAX <= value <= _INT32_MAX:
            return const_literal(node)  # past a 32-bit index: a literal (a draw of 2**31)
        else:  # passed as the index type, as sizes are (flame/runtime/launch.py)
            arg = Arg("size", size_args.index, name, value)
        size_args[id(node)] = arg
    return arg.name


def header(group: Group) -> tuple[str, ...]:
    """The group as IR text, each line with the user line that built it."""
    names = {id(node): f"%{index}" for index, node in enumerate(group.nodes)}
    count = 0
    for node in group.nodes:
        for child in node.inputs:
            if id(child) not in names:
                names[id(child)] = f"in{count}"
                count += 1
    lines = []
    for node in group.nodes:
        arguments = [names[id(child)] for child in node.inputs]
        arguments += [f"{key}={format_value(value)}" for key, value in node.attrs]
        text = f"{names[id(node)]}: {format_type(node)} = {node.op}({', '.join(arguments)})"
        if node.site is not None:
            text = text.ljust(48) + f"  # {format_site(node.site)}"
        lines.append(text)
    lines.append("writes " + ", ".join(names[id(node)] for node in group.outputs))
    return tuple(lines)


def kernel_stem(group: Group) -> str:
    ops = [n.op for n in group.nodes if n.inputs and n.op not in MOVEMENT_OPS]
    return "_".join(dict.fromkeys(ops))[:40] or "copy"


def buffer_params(group: Group, reads: list[Read]) -> tuple[list, list[Read]]:
    """The ``out``/``in`` parameters every kernel starts with (outputs, then the buffers it
    reads; generated reads have none), naming each read's parameter."""
    from flame.codegen.spec import Arg

    params = [
        Arg("out", f"{output.dtype.c_storage}*", f"out{position}", operand=position)
        for position, output in enumerate(group.outputs)
    ]
    buffers = [read for read in reads if not read.generated]
    operand = 0  # the read's place among the buffers (each read's own: names are unique)
    for position, read in enumerate(reads):
        read.param = f"in{position}"
        if not read.generated:
            ctype = f"const {read.base.dtype.c_storage}* __restrict__"
            params.append(Arg("in", ctype, read.param, operand=operand))
            operand += 1
    return params, buffers
