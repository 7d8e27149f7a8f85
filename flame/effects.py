"""What a compiled program does besides computing its results, recorded while tracing
(``Trace``) and done at every call: ``.grad`` assignments (in flame/compile.py), advancing
the generators it draws from (``drawing``: the generated entry of a program that draws), and
in-place writes to memory (``direct_writes``: the plan's kernel writes the memory where
that is safe; ``write_back``: otherwise the value is copied in after the call).
"""

from __future__ import annotations

from flame.ir.node import Node
from flame.replay import MISS
from flame.runtime.storage import storage_of
from flame.tensor import Tensor


class Trace:
    """What one trace records besides the graph: the ``.grad`` assignments of backward(),
    the numbers drawn from each generator, and the in-place writes to memory."""

    def __init__(self):
        self.grads: dict[int, tuple] = {}  # id(owner) -> (owner, grad held before)
        self.cleared: set[int] = set()  # owners whose first touch was zero_grad: not read
        self.draws: dict = {}  # generator -> numbers the traced function draws from it
        # in-place writes to memory: id(storage) -> [storage, the last value written,
        # (tensor, its node before the trace) per tensor written]
        self.writes: dict[int, list] = {}
        self._written_by: dict[int, object] = {}  # id(tensor written) -> its storage
        self.written: tuple = ()  # the writes as the program makes them (set by _build)

    def note_write(self, target: Tensor, storage, value: Node) -> None:
        entry = self.writes.setdefault(id(storage), [storage, value, []])
        entry[1] = value
        if all(tensor is not target for tensor, _ in entry[2]):
            entry[2].append((target, target.node))  # kept alive here: its id stays its own
            self._written_by.setdefault(id(target), storage)

    def storage_written(self, target: Tensor):
        """The memory ``target`` stands for, if this trace wrote it before (the first
        memory it was written as, as a walk over the writes in order found it)."""
        return self._written_by.get(id(target))

    def restore_written(self) -> None:
        """The written tensors read their memory again (the replay writes it)."""
        for _, _, tensors in self.writes.values():
            for tensor, node in tensors:
                tensor.node = node

    def note_draw(self, generator, count: int) -> int:
        """A draw of ``count`` numbers: its offset within the call's draws."""
        local = self.draws.get(generator, 0)
        self.draws[generator] = local + count
        return local

    def note_grad(self, owner: Tensor) -> None:
        if id(owner) not in self.grads:
            self.grads[id(owner)] = (owner, owner.grad)

    def note_grad_cleared(self, owner: Tensor) -> None:
        """``zero_grad()`` replaces ``owner.grad`` before anything in the trace used it: the
        program never reads the gradient held before, whether there is one or not."""
        if id(owner) not in self.grads:
            self.note_grad(owner)
            self.cleared.add(id(owner))


def direct_writes(program, order, inputs, trace) -> tuple:
    """Per in-place write of a CUDA program, the output slot its plan writes straight into
    the tensor's memory, or None where the value must be computed apart and copied (the
    memory is read through a view or by a reduction, or a library call computes it)."""
    from flame.runtime.writes import reads_elementwise, writable

    # the plan inputs of each memory, found once (a scan of every input per write was
    # quadratic: 1.5 M comparisons, ~0.5 s of the UNet step's first call on the CPU probe)
    inputs_of: dict[tuple, list[int]] = {}
    for slot, source in enumerate(program.sources):
        inputs_of.setdefault(_memory(source), []).append(slot)
    direct = []
    written = set()  # the output slots already written straight into a tensor's memory
    for (target, index), (storage, value, _) in zip(program.writes, trace.writes.values()):
        kind, position = program.flat[index]
        array = storage.array
        contiguous = array is not None and array.flags.c_contiguous
        if kind != "out" or not contiguous or tuple(array.shape) != value.shape:
            direct.append(None)
            continue
        aliased = inputs_of.get(_memory(target), [])
        slot = program.plan.output_slots[position]
        safe = reads_elementwise(order, [inputs[i] for i in aliased], value.shape)
        if slot in written:  # one value written into two tensors: the second gets a copy
            safe = False
        if safe and writable(program.plan, slot, aliased):
            written.add(slot)
            direct.append(slot)
        else:
            direct.append(None)
    return tuple(direct)


def _memory(source: tuple) -> tuple:
    """What identifies the memory of a plan input's source or a write's target: a storage
    by identity, an argument (or a gradient held before) by its position."""
    kind, value = source
    return (kind, id(value)) if kind == "storage" else (kind, value)


def drawing(entry, generators, backend: str):
    """A generated entry of a program that draws random numbers: the generators advance
    (their state buffers written, stream-ordered) before its launch, and take the numbers
    back when the entry turns out not to match the call (``MISS``)."""

    def drawing(args):
        for generator, count in generators:
            generator._advance_for_call(backend, count)
        result = entry(args)
        if result is MISS:
            for generator, count in generators:
                generator._take(-count)
        return result

    return drawing


def write_back(storage, value: Tensor) -> None:
    """An in-place write of a compiled program: its value copied into the memory."""
    source = storage_of(value.node)
    if storage.backend == "reference":
        from flame.foreach import writable_array

        writable_array(storage)[...] = source.numpy().reshape(storage.array.shape)
    else:
        array = storage.device_array()
        array[...] = source.device_array().reshape(array.shape)
