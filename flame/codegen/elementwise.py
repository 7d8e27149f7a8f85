"""Lowering of an elementwise group to a ``KernelSpec``.

The iteration space is the group's shape. Every value the kernel reads (a buffer, or a leaf
generated from the element index) is seen through a strided view over that space (stride 0
where it is broadcast; transposes and slices are just other strides). Adjacent dimensions that
every operand walks contiguously are collapsed, so most kernels iterate one flat dimension.

What goes into the source (and so into the cache key): dtypes, the collapsed rank, which
strides are 0 (the broadcast pattern), which operands are contiguous, the vector width and
the index width. What does not: sizes, offsets and other strides, which are arguments.
"""

from __future__ import annotations

import hashlib

from flame.codegen.common import (
    INDEX_LEAVES,
    Helpers,
    Read,
    SizeArgs,
    buffer_params,
    collect_reads,
    const_text,
    generated_expression,
    header,
    is_scalar_const,
    kernel_stem,
    load,
    op_expression,
    store,
)  # fmt: skip
from flame.codegen.spec import Arg, KernelSpec
from flame.ir.graph import Group
from flame.ir.node import Node
from flame.ir.shapes import contiguous_strides, prod
from flame.ir.views import MOVEMENT_OPS, expand_view
from flame.records import Record

VECTOR_BYTES = 16
MAX_VEC = 8  # 16 bytes of 16-bit values: one 128-bit load per operand
BLOCK = 256


class Lowered(Record, frozen=True):
    """A group lowered to one kernel: its spec and what its parameters bind to."""

    spec: KernelSpec
    reads: tuple[Node, ...]  # buffers the kernel reads, in ``in`` parameter order
    outputs: tuple[Node, ...]  # values it writes, in ``out`` parameter order
    numel: int
    grid_items: int = 0  # work items the launch must cover (defaults to numel / vec)
    zeroed: tuple[int, ...] = ()  # outputs set to zero before the launch (atomic sums)
    threads: int = 0  # threads a block (defaults to spec.block, the launch bound)
    shared_bytes: int = 0  # dynamic shared memory a block needs (a row held there)


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


def index_type_for(numel: int, reads) -> str:
    reach = numel
    for read in reads:
        span = sum(
            (size - 1) * abs(stride) for size, stride in zip(read.view.shape, read.view.strides)
        )
        reach = max(reach, read.view.offset + span + 1)
    return "int" if reach + numel < 2**31 - 1 else "long long"


def lower_elementwise(group: Group, layout_of) -> Lowered:
    """``layout_of(node) -> (strides in elements, aligned to 16 bytes)`` for buffers read."""
    space = group.outputs[0].shape
    reads, aliases = collect_reads(group, layout_of)
    if any(base.op != "const" for base in aliases.values()):
        raise ValueError("an elementwise kernel cannot read its own values through views")
    views = [expand_view(read.view, space) for read in reads]
    sizes, collapsed = collapse(space, [contiguous_strides(space)] + [v.strides for v in views])
    for read, view, strides in zip(reads, views, collapsed[1:]):
        read.strides, read.offset = strides, view.offset
    vec = _choose_vec(sizes, reads, group.outputs)
    writer = _Writer(group, sizes, reads, vec, index_type_for(prod(space), reads))
    for top, constant in aliases.items():  # a broadcast constant is its literal
        writer.values[top] = writer.tail_values[top] = const_text(constant, writer.size_args)
    return writer.build(prod(space))


# the vector width follows the operands read as vectors (contiguous ones) and the outputs:
# a scalar (an optimizer's int64 step) is read once, a broadcast operand (a float32 bias next
# to bfloat16 activations) one element a lane, so neither narrows the others' loads
VEC_FROM_FLAT_READS = True


def _choose_vec(sizes, reads, outputs) -> int:
    if not sizes:
        return 1
    flat = contiguous_strides(sizes)
    sized = reads
    if VEC_FROM_FLAT_READS:
        sized = [r for r in reads if r.generated or r.strides == flat]
    itemsizes = [r.base.dtype.itemsize for r in sized] + [o.dtype.itemsize for o in outputs]
    vec = min(max(1, VECTOR_BYTES // max(itemsizes)), MAX_VEC)
    for read in reads:
        if read.strides == flat and not read.generated and (not read.aligned or read.offset % vec):
            return 1
    if len(sizes) > 1 and sizes[-1] % vec != 0:
        return 1
    return vec


class _Writer:
    """Emits the C lines of one elementwise kernel."""

    def __init__(self, group, sizes, reads: list[Read], vec, index_type):
        self.group, self.sizes, self.reads = group, sizes, reads
        self.vec, self.index = vec, index_type
        self.flat = contiguous_strides(sizes)
        self.params: list[Arg] = []
        self.setup, self.prologue, self.body, self.epilogue, self.tail = [], [], [], [], []
        self.helpers = Helpers()
        self.values: dict[int, str] = {}
        self.tail_values: dict[int, str] = {}
        self.needs_tail = vec > 1 and len(sizes) <= 1
        self.axis_index: list[str] = []
        self.size_args = SizeArgs(group, index_type)  # constants as arguments (const_text)

    def build(self, numel) -> Lowered:
        self.params, buffers = buffer_params(self.group, self.reads)
        self.params.append(Arg("size", self.index, "n", numel))
        self._index_math()
        for read in self.reads:
            self._read(read)
        for node in self.group.nodes:
            self._compute(node)
        for position, output in enumerate(self.group.outputs):
            self._write(position, output)
        self.params.extend(self.size_args.values())
        reads = tuple(read.base for read in buffers)
        return Lowered(self._spec(), reads, tuple(self.group.outputs), numel)

    def _index_math(self):
        strided = [r for r in self.reads if not _is_scalar(r) and r.strides != self.flat]
        if not strided or len(self.sizes) <= 1:
            self.axis_index = ["base"] * len(self.sizes)
            return
        self.prologue.append(f"{self.index} rest = base;")
        names = []
        for axis in range(len(self.sizes) - 1, 0, -1):
            self.params.append(Arg("size", self.index, f"size{axis}", self.sizes[axis]))
            self.prologue.append(
                f"const {self.index} i{axis} = rest % size{axis}; rest /= size{axis};"
            )
            names.append(f"i{axis}")
        self.prologue.append(f"const {self.index} i0 = rest;")
        self.axis_index = ["i0"] + list(reversed(names))

    def _offset(self, read: Read) -> tuple[str, str]:
        """C expressions: the read's offset at the vector's first element, and its step per
        lane (the innermost stride: literal when it is 0 or 1, the broadcast pattern)."""
        terms = []
        if read.offset:
            self.params.append(Arg("size", self.index, f"{read.param}_offset", read.offset))
            terms.append(f"{read.param}_offset")
        last = len(self.sizes) - 1
        for axis, stride in enumerate(read.strides):
            if stride == 0:
                continue
            name = f"{read.param}_s{axis}"
            literal = axis == last and stride == 1
            if not literal:
                self.params.append(Arg("stride", self.index, name, stride))
            terms.append(self.axis_index[axis] if literal else f"{self.axis_index[axis]} * {name}")
        inner = read.strides[last] if read.strides else 0
        step = "0" if inner == 0 else ("1" if inner == 1 else f"{read.param}_s{last}")
        return (" + ".join(terms) or "0"), step

    def _read(self, read: Read):
        name = f"v{len(self.values)}"
        ctype = read.top.dtype.c_compute
        flat = read.strides == self.flat and read.offset == 0
        if read.generated:
            if flat:
                index, tail_index = "(base + k)", "e"
            else:
                offset, step = self._offset(read)
                self.prologue.append(f"const {self.index} {name}_at = {offset};")
                index, tail_index = f"({name}_at + k * {step})", self._tail_offset(read, step)
            self.body.append(
                f"const {ctype} {name} = {generated_expression(read.base, index, self.helpers)};"
            )
            self.tail.append(
                f"const {ctype} {name} = "
                f"{generated_expression(read.base, tail_index, self.helpers)};"
            )
        elif _is_scalar(read):
            # an element picked by an index (alphas[t]): its offset is an argument, 0 included,
            # so every t runs one kernel
            at = f"{read.param}[{read.param}_offset]"
            self.params.append(Arg("size", self.index, f"{read.param}_offset", read.offset))
            self.setup.append(f"const {ctype} {name} = {load(read.base.dtype, at)};")
        elif flat and self.vec > 1:
            vector = f"FlameVec<{read.base.dtype.c_storage}, {self.vec}>"
            pointer = f"reinterpret_cast<const {vector}*>({read.param} + base)"
            self.prologue.append(f"const {vector} {name}_vec = *{pointer};")
            self.body.append(f"const {ctype} {name} = {load(read.base.dtype, f'{name}_vec.v[k]')};")
            self.tail.append(f"const {ctype} {name} = {load(read.base.dtype, f'{read.param}[e]')};")
        else:
            offset, step = self._offset(read)
            self.prologue.append(f"const {self.index} {name}_at = {offset};")
            lane = f"{name}_at" if step == "0" else f"{name}_at + k * {step}"
            self.body.append(
                f"const {ctype} {name} = {load(read.base.dtype, f'{read.param}[{lane}]')};"
            )
            at = self._tail_offset(read, step)
            self.tail.append(
                f"const {ctype} {name} = {load(read.base.dtype, f'{read.param}[{at}]')};"
            )
        self.values[id(read.top)] = self.tail_values[id(read.top)] = name

    def _tail_offset(self, read: Read, step: str) -> str:
        base = f"{read.param}_offset + " if read.offset else ""
        return f"{base}e * {step}" if step != "1" or read.offset else "e"

    def _compute(self, node):
        if id(node) in self.values or node.op in MOVEMENT_OPS or node.op in INDEX_LEAVES:
            return  # views and generated leaves are reads, bound where they are used
        if is_scalar_const(node) or node.op == "const":
            self.values[id(node)] = self.tail_values[id(node)] = const_text(node, self.size_args)
            return
        name = f"v{len(self.values)}"
        ctype = node.dtype.c_compute
        body = op_expression(node, [self._value(c, self.values) for c in node.inputs], self.helpers)
        tail = op_expression(
            node, [self._value(c, self.tail_values) for c in node.inputs], self.helpers
        )
        self.body.append(f"const {ctype} {name} = {body};")
        self.tail.append(f"const {ctype} {name} = {tail};")
        self.values[id(node)] = self.tail_values[id(node)] = name

    def _value(self, node, values) -> str:
        if id(node) not in values and node.op == "const":
            values[id(node)] = const_text(node, self.size_args)
        return values[id(node)]

    def _write(self, position, output):
        value = self._value(output, self.values)
        storage = output.dtype.c_storage
        if self.vec > 1:
            vector = f"FlameVec<{storage}, {self.vec}>"
            self.prologue.append(f"{vector} out{position}_vec;")
            self.body.append(f"out{position}_vec.v[k] = {store(output.dtype, value)};")
            self.epilogue.append(
                f"*reinterpret_cast<{vector}*>(out{position} + base) = out{position}_vec;"
            )
        else:
            self.body.append(f"out{position}[base] = {store(output.dtype, value)};")
        tail_value = self._value(output, self.tail_values)
        self.tail.append(f"out{position}[e] = {store(output.dtype, tail_value)};")

    def _spec(self) -> KernelSpec:
        digest_source = "\n".join(
            [self.index, str(self.vec)]
            + [f"{a.kind} {a.ctype} {a.name}" for a in self.params]
            + self.setup
            + self.prologue
            + self.body
            + self.epilogue
            + self.helpers.sources
        )
        digest = hashlib.sha256(digest_source.encode()).hexdigest()[:10]
        return KernelSpec(
            name=f"flame_ew_{kernel_stem(self.group)}_{digest}",
            template="elementwise.cu.j2",
            index_type=self.index,
            vec=self.vec,
            block=BLOCK,
            params=tuple(self.params),
            header=header(self.group),
            helpers=tuple(self.helpers.sources),
            setup=tuple(self.setup),
            prologue=tuple(self.prologue),
            body=tuple(self.body),
            epilogue=tuple(self.epilogue),
            tail=tuple(self.tail) if self.needs_tail else (),
            count=f"n / {self.vec}" if self.vec > 1 else "n",
            size_class=f"{len(self.sizes)} axes, {self.vec} lanes, "
            f"{'int64' if self.index != 'int' else 'int32'} index",
        )


def _is_scalar(read: Read) -> bool:
    return all(stride == 0 for stride in read.strides)
