"""Lowering of an elementwise group to a ``KernelSpec``.

The iteration space is the group's shape. Every value the kernel reads (a buffer, or a leaf
generated from the element index) gets an *index map*: its strides over the iteration space,
with 0 where it is broadcast. Adjacent dimensions that every operand walks contiguously are
collapsed, so most kernels iterate one flat dimension.

What goes into the source (and so into the cache key): dtypes, the collapsed rank, which
strides are 0 (the broadcast pattern), whether an operand is contiguous, the vector width and
the index width. What does not: sizes and the other strides, which are kernel arguments.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from flame.codegen.spec import Arg, KernelSpec, c_literal
from flame.ir import dtypes
from flame.ir.graph import Group
from flame.ir.node import Node, format_site
from flame.ir.ops import HELPERS, get_op
from flame.ir.printer import format_type, format_value
from flame.ir.shapes import contiguous_strides, prod

VECTOR_BYTES = 16
MAX_VEC = 4
BLOCK = 256
INDEX_LEAVES = ("rand", "randn", "arange")


@dataclass(frozen=True)
class Lowered:
    spec: KernelSpec
    reads: tuple[Node, ...]  # buffers the kernel reads, in ``in`` parameter order
    outputs: tuple[Node, ...]  # values it writes, in ``out`` parameter order
    numel: int


@dataclass
class _Operand:
    node: Node
    strides: tuple[int, ...]  # over the collapsed iteration space
    param: str = ""
    aligned: bool = True
    generated: bool = False  # computed from the element index (rand, arange), not loaded

    @property
    def is_scalar(self) -> bool:
        return all(stride == 0 for stride in self.strides)


def broadcast_strides(shape, strides, space) -> tuple[int, ...]:
    """Strides of an operand of ``shape`` over the iteration ``space`` (0 where broadcast)."""
    offset = len(space) - len(shape)
    return tuple(
        0 if axis < offset or shape[axis - offset] == 1 else strides[axis - offset]
        for axis in range(len(space))
    )


def collapse(space, stride_sets):
    """Drop size-1 axes and merge neighbours every operand walks contiguously."""
    keep = [axis for axis, size in enumerate(space) if size != 1]
    sizes = [space[axis] for axis in keep]
    sets = [[strides[axis] for axis in keep] for strides in stride_sets]
    axis = len(sizes) - 1
    while axis > 0:
        if all(strides[axis - 1] == strides[axis] * sizes[axis] for strides in sets):
            sizes[axis - 1] *= sizes[axis]
            del sizes[axis]
            for strides in sets:
                strides[axis - 1] = strides[axis]
                del strides[axis]
        axis -= 1
    return tuple(sizes), [tuple(strides) for strides in sets]


def _load(dtype: dtypes.DType, expression: str) -> str:
    if dtype is dtypes.float16:
        return f"flame_load_f16({expression})"
    if dtype is dtypes.bfloat16:
        return f"flame_load_bf16({expression})"
    return expression


def _store(dtype: dtypes.DType, expression: str) -> str:
    if dtype is dtypes.float16:
        return f"flame_store_f16({expression})"
    if dtype is dtypes.bfloat16:
        return f"flame_store_bf16({expression})"
    return expression


def cast_expression(source: dtypes.DType, target: dtypes.DType, value: str) -> str:
    if target.is_bool:
        return value if source.is_bool else f"({value} != 0)"
    if target.is_float:
        converted = value if source.is_float else f"(float){value}"
        if target in (dtypes.float16, dtypes.bfloat16):
            converted = _load(target, _store(target, converted))
        return converted
    return f"({target.c_compute}){value}"


class _Lowering:
    def __init__(self, group: Group, layout_of):
        self.group = group
        self.space = group.outputs[0].shape
        self.members = {id(node) for node in group.nodes}
        self.reads: list[Node] = []
        self.generated: list[Node] = []
        for node in group.nodes:
            for child in node.inputs:
                if id(child) not in self.members and child not in self.reads:
                    self.reads.append(child)
            if node.op in INDEX_LEAVES:
                self.generated.append(node)
        self.layout_of = layout_of

    def operands(self):
        full = []
        for node in self.reads:
            strides, aligned = self.layout_of(node)
            full.append((node, broadcast_strides(node.shape, strides, self.space), aligned))
        for node in self.generated:
            strides = contiguous_strides(node.shape)
            full.append((node, broadcast_strides(node.shape, strides, self.space), True))
        output_strides = contiguous_strides(self.space)
        sizes, collapsed = collapse(self.space, [output_strides] + [s for _, s, _ in full])
        operands = [
            _Operand(node, strides, aligned=aligned, generated=position >= len(self.reads))
            for position, ((node, _, aligned), strides) in enumerate(zip(full, collapsed[1:]))
        ]
        return sizes, operands


def _choose_vec(sizes, operands, outputs) -> int:
    itemsizes = [op.node.dtype.itemsize for op in operands] + [o.dtype.itemsize for o in outputs]
    vec = max(1, VECTOR_BYTES // max(itemsizes))
    vec = min(vec, MAX_VEC)
    if not sizes:
        return 1
    flat = contiguous_strides(sizes)
    for operand in operands:
        if operand.strides == flat and not operand.generated and not operand.aligned:
            return 1
    if len(sizes) > 1 and sizes[-1] % vec != 0:
        return 1
    return vec


def lower_elementwise(group: Group, layout_of) -> Lowered:
    """``layout_of(node) -> (strides in elements, aligned to 16 bytes)`` for buffers read."""
    lowering = _Lowering(group, layout_of)
    sizes, operands = lowering.operands()
    numel = prod(sizes)
    vec = _choose_vec(sizes, operands, group.outputs)
    reach = max([numel] + [sum((s - 1) * abs(t) for s, t in zip(sizes, op.strides)) + 1 for op in operands])
    index_type = "int" if reach + numel < 2**31 - 1 else "long long"
    writer = _Writer(group, sizes, operands, vec, index_type)
    return writer.build(lowering.reads, numel)


class _Writer:
    """Emits the C lines of one elementwise kernel."""

    def __init__(self, group, sizes, operands, vec, index_type):
        self.group, self.sizes, self.operands = group, sizes, operands
        self.vec, self.index = vec, index_type
        self.flat = contiguous_strides(sizes)
        self.params: list[Arg] = []
        self.setup, self.prologue, self.body, self.epilogue, self.tail = [], [], [], [], []
        self.helpers: list[str] = []
        self.values: dict[int, str] = {}
        self.tail_values: dict[int, str] = {}
        self.needs_tail = vec > 1 and len(sizes) <= 1

    def build(self, reads, numel) -> Lowered:
        for position, output in enumerate(self.group.outputs):
            self.params.append(Arg("out", f"{output.dtype.c_storage}*", f"out{position}", operand=position))
        read_index = {id(node): position for position, node in enumerate(reads)}
        for position, operand in enumerate(self.operands):
            operand.param = f"in{position}"
            if not operand.generated:
                ctype = f"const {operand.node.dtype.c_storage}* __restrict__"
                self.params.append(Arg("in", ctype, operand.param, operand=read_index[id(operand.node)]))
        self.params.append(Arg("size", self.index, "n", numel))
        self._index_math()
        for operand in self.operands:
            self._read(operand)
        for node in self.group.nodes:
            self._compute(node)
        for position, output in enumerate(self.group.outputs):
            self._write(position, output)
        return Lowered(self._spec(), tuple(reads), tuple(self.group.outputs), numel)

    def _index_math(self):
        strided = [op for op in self.operands if not op.is_scalar and op.strides != self.flat]
        if not strided or len(self.sizes) <= 1:
            self.axis_index = ["base"] * len(self.sizes)
            return
        self.prologue.append(f"{self.index} rest = base;")
        names = []
        for axis in range(len(self.sizes) - 1, 0, -1):
            self.params.append(Arg("size", self.index, f"size{axis}", self.sizes[axis]))
            self.prologue.append(f"const {self.index} i{axis} = rest % size{axis}; rest /= size{axis};")
            names.append(f"i{axis}")
        self.prologue.append(f"const {self.index} i0 = rest;")
        self.axis_index = ["i0"] + list(reversed(names))

    def _offset(self, operand) -> tuple[str, str]:
        """C expressions: the operand's offset at the vector's first element, and its step per
        lane (the innermost stride: literal when it is 0 or 1, the broadcast pattern)."""
        terms = []
        last = len(self.sizes) - 1
        for axis, stride in enumerate(operand.strides):
            if stride == 0:
                continue
            name = f"{operand.param}_s{axis}"
            literal = axis == last and stride == 1
            if not literal:
                self.params.append(Arg("stride", self.index, name, stride))
            terms.append(self.axis_index[axis] if literal else f"{self.axis_index[axis]} * {name}")
        inner = operand.strides[last] if operand.strides else 0
        step = "0" if inner == 0 else ("1" if inner == 1 else f"{operand.param}_s{last}")
        return (" + ".join(terms) or "0"), step

    def _read(self, operand):
        node, name = operand.node, f"v{len(self.values)}"
        ctype = node.dtype.c_compute
        if operand.generated:
            self._generate(operand, name)
            return
        pointer = operand.param
        if operand.is_scalar:
            self.setup.append(f"const {ctype} {name} = {_load(node.dtype, pointer + '[0]')};")
            self.values[id(node)] = self.tail_values[id(node)] = name
            return
        if operand.strides == self.flat and self.vec > 1:
            storage = node.dtype.c_storage
            vector = f"FlameVec<{storage}, {self.vec}>"
            self.prologue.append(f"const {vector} {name}_vec = *reinterpret_cast<const {vector}*>({pointer} + base);")
            self.body.append(f"const {ctype} {name} = {_load(node.dtype, f'{name}_vec.v[k]')};")
            self.tail.append(f"const {ctype} {name} = {_load(node.dtype, f'{pointer}[e]')};")
        else:
            offset, step = self._offset(operand)
            self.prologue.append(f"const {self.index} {name}_at = {offset};")
            lane = f"{name}_at" if step == "0" else f"{name}_at + k * {step}"
            self.body.append(f"const {ctype} {name} = {_load(node.dtype, f'{pointer}[{lane}]')};")
            tail_offset = "e" if operand.strides == self.flat else f"e * {step}"
            self.tail.append(f"const {ctype} {name} = {_load(node.dtype, f'{pointer}[{tail_offset}]')};")
        self.values[id(node)] = self.tail_values[id(node)] = name

    def _generate(self, operand, name):
        node = operand.node
        op = get_op(node.op)
        self._need(op.helpers)
        if operand.strides == self.flat:
            index, tail_index = "(base + k)", "e"
        else:
            offset, step = self._offset(operand)
            self.prologue.append(f"const {self.index} {name}_at = {offset};")
            index, tail_index = f"({name}_at + k * {step})", f"(e * {step})"
        category = node.dtype.category if node.op == "arange" else 2
        template = op.expression(category)
        literals = {key: c_literal(value, node.dtype) for key, value in node.attrs if key != "seed"}
        seed = node.attr("seed", 0)
        ctype = node.dtype.c_compute
        body = template.format(index=index, seed=seed, **literals)
        tail = template.format(index=tail_index, seed=seed, **literals)
        self.body.append(f"const {ctype} {name} = {cast_expression(dtypes.float32, node.dtype, body) if category == 2 else body};")
        self.tail.append(f"const {ctype} {name} = {cast_expression(dtypes.float32, node.dtype, tail) if category == 2 else tail};")
        self.values[id(node)] = self.tail_values[id(node)] = name

    def _need(self, helper_names):
        for helper in helper_names:
            source = HELPERS[helper]
            if source not in self.helpers:
                self.helpers.append(source)

    def _compute(self, node):
        if id(node) in self.values:
            return
        if node.op == "expand":  # an index map, already applied to the leaves below it
            self.values[id(node)] = self.values[id(node.inputs[0])]
            self.tail_values[id(node)] = self.tail_values[id(node.inputs[0])]
            return
        if node.op == "const":
            literal = c_literal(node.attr("value"), node.dtype)
            self.values[id(node)] = self.tail_values[id(node)] = literal
            return
        name = f"v{len(self.values)}"
        expression = self._expression(node, [self.values[id(child)] for child in node.inputs])
        self.body.append(f"const {node.dtype.c_compute} {name} = {expression};")
        self.tail.append(f"const {node.dtype.c_compute} {name} = {self._expression(node, [self.tail_values[id(c)] for c in node.inputs])};")
        self.values[id(node)] = self.tail_values[id(node)] = name

    def _expression(self, node, arguments) -> str:
        if node.op == "cast":
            return cast_expression(node.inputs[0].dtype, node.dtype, arguments[0])
        op = get_op(node.op)
        self._need(op.helpers)
        category = node.inputs[-1].dtype.category
        literals = {key: _attr_literal(value) for key, value in node.attrs}
        return op.expression(category).format(*arguments, **literals)

    def _write(self, position, output):
        value = self.values[id(output)]
        storage = output.dtype.c_storage
        if self.vec > 1:
            vector = f"FlameVec<{storage}, {self.vec}>"
            self.prologue.append(f"{vector} out{position}_vec;")
            self.body.append(f"out{position}_vec.v[k] = {_store(output.dtype, value)};")
            self.epilogue.append(f"*reinterpret_cast<{vector}*>(out{position} + base) = out{position}_vec;")
        else:
            self.body.append(f"out{position}[base] = {_store(output.dtype, value)};")
        self.tail.append(f"out{position}[e] = {_store(output.dtype, self.tail_values[id(output)])};")

    def _spec(self) -> KernelSpec:
        header = _header(self.group)
        digest_source = "\n".join(
            [self.index, str(self.vec)] + [f"{a.kind} {a.ctype} {a.name}" for a in self.params]
            + self.setup + self.prologue + self.body + self.epilogue + self.helpers
        )
        digest = hashlib.sha256(digest_source.encode()).hexdigest()[:10]
        ops = [node.op for node in self.group.nodes if node.inputs and node.op != "expand"]
        stem = "_".join(dict.fromkeys(ops))[:40] or "copy"
        return KernelSpec(
            name=f"flame_ew_{stem}_{digest}",
            template="elementwise.cu.j2",
            index_type=self.index,
            vec=self.vec,
            block=BLOCK,
            params=tuple(self.params),
            header=header,
            helpers=tuple(self.helpers),
            setup=tuple(self.setup),
            prologue=tuple(self.prologue),
            body=tuple(self.body),
            epilogue=tuple(self.epilogue),
            tail=tuple(self.tail) if self.needs_tail else (),
            count=f"n / {self.vec}" if self.vec > 1 else "n",
        )


def _attr_literal(value) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    return c_literal(value, dtypes.float32)


def _header(group: Group) -> tuple[str, ...]:
    """The group as IR text, each line with the user line that built it."""
    names = {id(node): f"%{index}" for index, node in enumerate(group.nodes)}
    for node in group.nodes:
        for child in node.inputs:
            names.setdefault(id(child), f"in{len(names) - len(group.nodes)}")
    lines = []
    for node in group.nodes:
        arguments = [names.get(id(child), "<in>") for child in node.inputs]
        arguments += [f"{key}={format_value(value)}" for key, value in node.attrs]
        text = f"{names[id(node)]}: {format_type(node)} = {node.op}({', '.join(arguments)})"
        if node.site is not None:
            text = text.ljust(48) + f"  # {format_site(node.site)}"
        lines.append(text)
    lines.append("writes " + ", ".join(names[id(node)] for node in group.outputs))
    return tuple(lines)
