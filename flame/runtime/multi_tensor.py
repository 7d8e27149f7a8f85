"""Launching a multi-tensor kernel: the pointer table, the chunk table, the kernel variants.

A ``MultiTensorKernel`` holds one rule's fused group and compiles, on demand, its variants
(vector loads when every address is aligned; 64-bit indices when a tensor needs them). The
chunk table depends only on the tensors' lengths, so it is built once per set of lengths; the
pointer table is rebuilt on every call (gradients are new buffers each step) and copied to
the GPU in one transfer.
"""

from __future__ import annotations

import functools
import threading
import weakref

import numpy as np

from flame.codegen.multi_tensor import CHUNK, lower_multi_tensor
from flame.codegen.render import render, spec_key
from flame.ir.graph import Group
from flame.runtime.staging import StagedUploads


class MultiTensorKernel:
    def __init__(self, group: Group, placeholders: list, executor):
        self.group = group
        self.placeholders = placeholders  # per list, the node that stands for its tensor
        self.varying = {id(node) for node in placeholders}
        self.position = {id(node): index for index, node in enumerate(placeholders)}
        self.executor = executor
        self._variants: dict[tuple, tuple] = {}
        self._chunks: dict[tuple, object] = {}
        self._columns: dict[int, tuple] = {}  # list position -> its last storages' addresses
        self._lock = threading.Lock()
        self._uploads = StagedUploads()  # the address tables' way to the GPU
        self._captured: dict[bytes, tuple] = {}  # tables CUDA graphs read (_device_table)

    def variant(self, aligned: bool, wide: bool):
        key = (aligned, wide)
        found = self._variants.get(key)
        if found is None:
            low = lower_multi_tensor(self.group, self.varying, aligned, wide)
            source = functools.partial(render, low.spec)
            (function,) = self.executor._load([(source, low.spec.name, spec_key(low.spec))])
            found = (low, function)
            with self._lock:
                self._variants[key] = found
        return found

    def chunks(self, lengths: tuple[int, ...]):
        table = self._chunks.get(lengths)
        if table is None:
            import cupy

            rows = [
                (tensor, start)
                for tensor, length in enumerate(lengths)
                for start in range(0, length, CHUNK)
            ]  # fmt: skip
            table = cupy.asarray(np.asarray(rows, dtype=np.int64).reshape(-1, 2))
            with self._lock:
                self._chunks[lengths] = table
        return table

    def _device_table(self, table: np.ndarray):
        """The address table on the GPU: staged (no wait for the GPU, staging.py); under a
        CUDA-graph capture (flame/runtime/step_graphs.py), a copy from page-locked memory of its own
        that the graph reads again at each replay, kept for the process (one per distinct
        table: a step's tables keep their addresses from call to call)."""
        import cupy

        stream = cupy.cuda.get_current_stream()
        if not stream.is_capturing():
            return self._uploads.put(table)
        key = table.tobytes()
        found = self._captured.get(key)
        if found is None:
            host = cupy.cuda.alloc_pinned_memory(table.nbytes)
            np.frombuffer(host, dtype=table.dtype, count=table.size)[...] = table.ravel()
            memory = cupy.get_default_memory_pool().malloc(table.nbytes)  # not the graph's
            device = cupy.ndarray(table.shape, table.dtype, memptr=memory)
            cupy.cuda.runtime.memcpyAsync(
                device.data.ptr, host.ptr, table.nbytes,
                cupy.cuda.runtime.memcpyHostToDevice, stream.ptr,
            )  # fmt: skip
            found = self._captured[key] = (device, host)
        return found[0]

    def _addresses(self, position: int, storages: list, held=None) -> tuple[list, list, bool]:
        """A column's addresses, lengths and alignment. Parameters and optimizer state are
        the same storages step after step (updated in place): their column is remembered
        (by weak reference, so it keeps nothing alive) and only gradients are looked up."""
        cached = self._columns.get(position)
        if cached is not None and len(cached[0]) == len(storages):
            refs = cached[0]
            if all(ref() is storage for ref, storage in zip(refs, storages)):
                return cached[1], cached[2], cached[3]
        addresses, lengths, copied = [], [], False
        for storage in storages:
            array = storage.array if storage.array is not None else storage.device_array()
            if not array._c_contiguous:
                if held is None:  # written in place: it must be one block of memory
                    raise ValueError(
                        f"foreach: a tensor of shape {list(array.shape)} is not contiguous"
                    )
                # read only (a gradient handed out as a transposed view): read a copy
                array = array.copy(order="C")
                held.append(array)
                copied = True
            addresses.append(array.data.ptr)
            lengths.append(array.size)
        aligned = all(address % 16 == 0 for address in addresses)
        if not copied:  # a copy's address is this launch's only
            refs = [weakref.ref(storage) for storage in storages]
            self._columns[position] = (refs, addresses, lengths, aligned)
        return addresses, lengths, aligned

    def launch(self, storages: list[list], outputs_into: list[int], shared: dict) -> None:
        """``storages[list][tensor]``: CUDA storages (contiguous; written in place for the
        lists named in ``outputs_into``, one per group output); ``shared``: id(node) -> array
        for the operands every tensor reads."""

        count = len(storages[0])
        if count == 0:
            return
        written = set(outputs_into)
        held = []  # contiguous copies of strided read-only operands, alive until the launch
        columns = [
            self._addresses(i, column, held if i not in written else None)
            for i, column in enumerate(storages)
        ]  # fmt: skip
        addresses = [column[0] for column in columns]
        lengths = tuple(columns[0][1])
        for column in columns[1:]:
            if tuple(column[1]) != lengths:
                raise ValueError("foreach: tensors of one index differ in size between lists")
        aligned = all(column[2] for column in columns)
        wide = max(lengths) + CHUNK >= 2**31 - 1
        low, function = self.variant(aligned, wide)
        table = np.empty((count, len(low.per_tensor) + 1), dtype=np.int64)
        for column, (kind, operand) in enumerate(low.per_tensor):
            if kind == "out":
                source = outputs_into[operand]
            else:
                source = self.position[id(low.lowered.reads[operand])]
            table[:, column] = addresses[source]
        table[:, -1] = lengths
        device_table = self._device_table(table)
        chunks = self.chunks(lengths)
        arguments = [device_table, chunks]
        for arg in low.spec.params:
            if arg.kind == "in":
                arguments.append(shared[id(low.shared[arg.operand])])
            elif arg.kind == "value":  # a constant derived from sizes: a float argument
                arguments.append((np.float64 if arg.ctype == "double" else np.float32)(arg.value))
            else:
                scalar = np.int64 if wide else np.int32
                arguments.append(scalar(arg.value))
        function((int(chunks.shape[0]),), (low.spec.block,), arguments)
