"""One block of memory for a captured step, its buffers placed at offsets planned ahead.

A step captured as a CUDA graph (flame/runtime/step_graphs.py) keeps the memory of its
intermediates between replays. Taken from a caching pool, buffer by buffer in the order the
plan allocates and releases them, that memory is the pool's high-water mark: a block freed
early is split for a smaller buffer, and a larger one later finds no free block that fits
(the DDPM UNet's step, b64 32x32, on the H100: 1.35 GB live at most, 1.79 GB in the pool).

A capture knows every allocation ahead: it is the plan, run in order. So the step is
captured twice. The first capture (never launched; its buffers first fit in one block the
size of the plan's planned peak) records each allocation's size and the moments it is made
and freed, whoever makes it (a kernel's output, a cuDNN workspace, a library call's
temporary). ``assign_offsets`` then places every buffer in one block so that buffers alive
at the same moment never overlap (greedy by size: the largest first, each at the lowest
offset free over its lifetime; the UNet's block is 1.2 % above its live peak). The second
capture, the one replayed, takes its buffers at those offsets. If it asks for anything else
than the first did -- another size, or a buffer freed later than recorded -- the offsets no
longer hold, and the caller captures again from the pool instead.

Offsets are planned on a 512-byte grid (CuPy's pool rounds the same way), so every buffer
keeps the alignment kernels' vector loads assume. Only allocations on the capture's stream
are placed; one made elsewhere makes the arena decline (``ArenaDeclined``).
"""

from __future__ import annotations

import bisect

import numpy as np

ALIGNMENT = 512  # bytes: offsets and sizes are rounded up to this, as CuPy's pool rounds


class ArenaDeclined(RuntimeError):
    """The second capture's allocations differ from the recorded ones: offsets do not hold."""


def _rounded(size: int) -> int:
    return max(ALIGNMENT, -(-size // ALIGNMENT) * ALIGNMENT)


def assign_offsets(sizes, starts, ends) -> tuple[list[int], int]:
    """Offsets (bytes) for buffers of ``sizes`` alive over ``[starts[i], ends[i])`` (integer
    moments), such that no two buffers alive at a common moment overlap, and the block's size.
    Greedy by size: the largest buffer first (ties: the earlier), each at the lowest offset
    where it overlaps no placed buffer alive at the same time."""
    count = len(sizes)
    rounded = np.array([_rounded(int(size)) for size in sizes], dtype=np.int64)
    begin = np.asarray(starts, dtype=np.int64)
    finish = np.asarray(ends, dtype=np.int64)
    order = sorted(range(count), key=lambda i: (-int(rounded[i]), int(begin[i])))
    offsets = np.zeros(count, dtype=np.int64)
    # the placed buffers, in placing order: lifetimes, offsets, sizes (contiguous slices)
    placed_begin = np.zeros(count, dtype=np.int64)
    placed_finish = np.zeros(count, dtype=np.int64)
    placed_low = np.zeros(count, dtype=np.int64)
    placed_high = np.zeros(count, dtype=np.int64)
    total = 0
    for done, index in enumerate(order):
        size, start, end = int(rounded[index]), begin[index], finish[index]
        alive = (placed_begin[:done] < end) & (placed_finish[:done] > start)
        offset = 0
        if alive.any():
            # the first gap of ``size`` bytes between the live buffers, by offset: before
            # the i-th, the highest end of those below it reaches ``reach[i]``
            by_low = np.argsort(placed_low[:done][alive], kind="stable")
            lows = placed_low[:done][alive][by_low]
            reach = np.maximum.accumulate(placed_high[:done][alive][by_low])
            below = np.concatenate(([0], reach[:-1]))
            fitting = np.flatnonzero(lows - below >= size)
            offset = int(below[fitting[0]] if fitting.size else reach[-1])
        offsets[index] = offset
        placed_begin[done], placed_finish[done] = start, end
        placed_low[done], placed_high[done] = offset, offset + size
        total = max(total, offset + size)
    return offsets.tolist(), total


def live_peak(sizes, starts, ends) -> int:
    """The most bytes alive at one moment (rounded sizes): no placement needs less."""
    moments = sorted(
        [(int(s), _rounded(int(n))) for n, s in zip(sizes, starts)]
        + [(int(e), -_rounded(int(n))) for n, e in zip(sizes, ends)]
    )  # at equal moments the free (negative) comes first: ends are exclusive
    live = peak = 0
    for _, change in moments:
        live += change
        peak = max(peak, live)
    return peak


class _Freed:
    """Held by one allocation's memory object: tells its allocator when the memory is freed
    (when the last array or view over it goes)."""

    __slots__ = ("allocator", "index")

    def __init__(self, allocator, index: int):
        self.allocator, self.index = allocator, index

    def __del__(self):
        self.allocator._freed(self.index)


class _FirstFit:
    """Offsets in a block of ``capacity`` bytes, first fit, freed ranges merged with their
    neighbours (the recording capture's own allocator: distinct memory for live buffers,
    without a device allocation each)."""

    def __init__(self, capacity: int):
        self.free = [(0, capacity)]  # (offset, size), by offset

    def take(self, size: int) -> int | None:
        for index, (offset, room) in enumerate(self.free):
            if room >= size:
                if room == size:
                    del self.free[index]
                else:
                    self.free[index] = (offset + size, room - size)
                return offset
        return None

    def give(self, offset: int, size: int) -> None:
        index = bisect.bisect(self.free, (offset, 0))
        if index < len(self.free) and offset + size == self.free[index][0]:
            size += self.free.pop(index)[1]
        if index and self.free[index - 1][0] + self.free[index - 1][1] == offset:
            offset, room = self.free[index - 1]
            self.free[index - 1] = (offset, room + size)
            return
        self.free.insert(index, (offset, size))


class _Returned:
    """Held by a recorded buffer placed in the recorder's block: gives its range back."""

    __slots__ = ("fit", "offset", "size", "block")

    def __init__(self, fit, offset: int, size: int, block):
        self.fit, self.offset, self.size, self.block = fit, offset, size, block

    def __del__(self):
        self.fit.give(self.offset, self.size)


class Recorder:
    """An allocator (for ``cupy.cuda.using_allocator``) for a capture that is never launched:
    it records every allocation (its size, and the moments it is made and freed). Buffers
    come from one block of ``capacity`` bytes taken from ``pool`` (first fit, reused once
    freed), or from ``pool`` itself when the block is full: every live buffer has memory of
    its own, as a replayed capture's would, without a device allocation each."""

    def __init__(self, pool, stream_ptr: int, capacity: int):
        self.pool = pool
        self.stream_ptr = stream_ptr
        self.capacity = _rounded(capacity)
        self.block = None
        self.fit = _FirstFit(self.capacity)
        self.sizes: list[int] = []
        self.starts: list[int] = []
        self.ends: list[int | None] = []
        self.free_order: list[int] = []
        self.frees_before: list[int] = []  # per allocation: frees made before it
        self.clock = 0
        self.foreign = False  # an allocation on another stream than the capture's

    def __call__(self, size: int):
        import cupy

        if cupy.cuda.get_current_stream().ptr != self.stream_ptr:
            self.foreign = True
        if self.block is None:
            self.block = self.pool.malloc(self.capacity)
        index = len(self.sizes)
        self.sizes.append(size)
        self.starts.append(self.clock)
        self.ends.append(None)
        self.frees_before.append(len(self.free_order))
        self.clock += 1
        offset = self.fit.take(_rounded(size))
        if offset is None:
            owner = self.pool.malloc(size)
            pointer = owner.ptr
        else:
            owner = _Returned(self.fit, offset, _rounded(size), self.block)
            pointer = self.block.ptr + offset
        memory = cupy.cuda.UnownedMemory(pointer, size, (owner, _Freed(self, index)))
        return cupy.cuda.MemoryPointer(memory, 0)

    def release(self) -> None:
        """Drop the recording's block (the buffers of the dropped capture are gone)."""
        self.block = None

    def _freed(self, index: int) -> None:
        self.ends[index] = self.clock
        self.free_order.append(index)
        self.clock += 1

    def plan(self) -> ArenaPlan:
        """The offsets for what was recorded (buffers never freed live to the end)."""
        if self.foreign:
            raise ArenaDeclined("an allocation on another stream than the capture's")
        ends = [self.clock + 1 if end is None else end for end in self.ends]
        offsets, total = assign_offsets(self.sizes, self.starts, ends)
        peak = live_peak(self.sizes, self.starts, ends)
        return ArenaPlan(
            tuple(self.sizes), tuple(offsets), total, peak, tuple(self.free_order),
            tuple(self.frees_before),
        )  # fmt: skip


class ArenaPlan:
    """Recorded sizes, their planned offsets, the block's size and the live peak; the order
    of the recorded frees, and how many came before each allocation."""

    __slots__ = ("sizes", "offsets", "total", "peak", "free_order", "frees_before")
    FORMAT = 1  # of ``to_bytes``

    def __init__(self, sizes, offsets, total: int, peak: int, free_order, frees_before):
        self.sizes, self.offsets, self.total, self.peak = sizes, offsets, total, peak
        self.free_order, self.frees_before = free_order, frees_before

    def to_bytes(self) -> bytes:
        """Little-endian int64s: format, counts, total, peak, then the four sequences."""
        head = [self.FORMAT, len(self.sizes), len(self.free_order), self.total, self.peak]
        parts = [head, self.sizes, self.offsets, self.frees_before, self.free_order]
        return np.concatenate([np.asarray(p, dtype="<i8") for p in parts]).tobytes()

    @classmethod
    def from_bytes(cls, data: bytes) -> ArenaPlan:
        """``to_bytes``'s plan; ``ValueError`` for anything else."""
        numbers = np.frombuffer(data, dtype="<i8")
        if len(numbers) < 5 or numbers[0] != cls.FORMAT:
            raise ValueError("not an arena plan of this format")
        count, frees, total, peak = (int(n) for n in numbers[1:5])
        if len(numbers) != 5 + 3 * count + frees:
            raise ValueError("an arena plan of the wrong length")
        body = numbers[5:].tolist()
        sizes, offsets = tuple(body[:count]), tuple(body[count : 2 * count])
        before, order = tuple(body[2 * count : 3 * count]), tuple(body[3 * count :])
        return cls(sizes, offsets, total, peak, order, before)


class ArenaAllocator:
    """Hands out the planned offsets of ``block`` (a ``MemoryPointer`` of ``plan.total``
    bytes) to the allocations of a capture that repeats the recorded one; any difference
    (another size, more allocations, a buffer freed out of the recorded order) is noted in
    ``diverged`` and served from ``fallback`` so that the capture can finish and be dropped.
    A buffer freed earlier than recorded is harmless (its offset stays unused); one freed
    later than recorded (fewer frees before an allocation than the recording had) could
    share memory with a buffer placed where it was free: that is a difference too."""

    def __init__(self, plan: ArenaPlan, block, fallback):
        self.plan, self.block, self.fallback = plan, block, fallback
        self.next = 0
        self.frees = 0
        self.diverged: str | None = None

    def __call__(self, size: int):
        import cupy

        index = self.next
        self.next += 1
        plan = self.plan
        if self.diverged is None and (index >= len(plan.sizes) or plan.sizes[index] != size):
            expected = plan.sizes[index] if index < len(plan.sizes) else None
            self.diverged = f"allocation {index}: {size} bytes, recorded {expected}"
        elif self.diverged is None and self.frees < plan.frees_before[index]:
            self.diverged = (
                f"allocation {index}: {self.frees} buffers freed before it, recorded "
                f"{plan.frees_before[index]}"
            )  # fmt: skip
        if self.diverged is not None:
            return self.fallback(size)
        pointer = self.block.ptr + plan.offsets[index]
        memory = cupy.cuda.UnownedMemory(pointer, size, (self.block, _Freed(self, index)))
        return cupy.cuda.MemoryPointer(memory, 0)

    def _freed(self, index: int) -> None:
        order = self.plan.free_order
        if self.diverged is None and (self.frees >= len(order) or order[self.frees] != index):
            self.diverged = f"free {self.frees}: allocation {index} out of the recorded order"
        self.frees += 1

    def check(self) -> None:
        """After the capture: raise ``ArenaDeclined`` unless it repeated the recording."""
        if self.diverged is None and self.next != len(self.plan.sizes):
            self.diverged = f"{self.next} allocations, recorded {len(self.plan.sizes)}"
        if self.diverged is not None:
            raise ArenaDeclined(self.diverged)
