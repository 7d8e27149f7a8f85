"""Generators, as in PyTorch: ``fl.manual_seed``, ``fl.Generator``, ``generator=`` on draws.

A generator is a seed and a counter offset. A draw of ``n`` numbers takes the counters
``offset .. offset + n`` and advances the offset by ``n``; number ``i`` of the draw is
Philox(key=seed, counter=offset + i), computed inside whatever kernel consumes it
(flame/ir/ops/random.py). Where the seed and offset come from:

* lazy mode: each draw reads a small int64 buffer holding (seed, offset) made for it (copied
  to the GPU through page-locked staging, so the host never waits), so a loop of draws runs
  one kernel with new numbers each time;
* inside ``flame.compile``: every draw reads the generator's own state buffer plus the draw's
  place in the trace (a constant), and the program advances the offset by all its draws at
  each call, writing the buffer first (stream-ordered). A replayed program or CUDA graph
  thus reads a new offset from memory at every call: new numbers, no retrace, no sync.

The same seed gives the same numbers in lazy, compiled and reference runs. The offset is kept
on the host; the host never reads the GPU to draw.
"""

from __future__ import annotations

import secrets
import threading
import weakref

import numpy as np

from flame.backend import get_backend
from flame.ir import dtypes
from flame.ir.node import Node, format_site, user_site
from flame.tensor import Tensor, apply

DEFAULT_SEED = 67280421310721  # PyTorch's default seed
_INT64 = np.int64
_generators: weakref.WeakSet = weakref.WeakSet()  # live generators (checkpoint rewinds them)


def _as_int64(value: int) -> int:
    """A 64-bit seed as the signed int64 holding the same bits."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


class Generator:
    """A Philox generator: ``manual_seed``, ``seed``, ``initial_seed``, ``get_state``,
    ``set_state``. ``device`` is accepted for PyTorch's signature; the same generator serves
    every backend."""

    def __init__(self, device=None):
        self.device = device
        self._seed = DEFAULT_SEED
        self._offset = 0
        self._lock = threading.Lock()
        self._states: dict[str, object] = {}  # backend -> Storage read by compiled programs
        _generators.add(self)

    def manual_seed(self, seed) -> Generator:
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise TypeError(f"manual_seed: seed must be an int, got {seed!r}")
        with self._lock:
            self._seed = int(seed) & ((1 << 64) - 1)
            self._offset = 0
        return self

    def seed(self) -> int:
        """Seed from the operating system's randomness; returns the seed."""
        value = secrets.randbits(63)
        self.manual_seed(value)
        return value

    def initial_seed(self) -> int:
        return self._seed

    def get_state(self) -> Tensor:
        """The state as an int64 tensor [seed, offset] (``set_state`` takes it back)."""
        from flame.creation import tensor

        return tensor(np.array([_as_int64(self._seed), self._offset], dtype=_INT64))

    def set_state(self, state) -> Generator:
        values = np.asarray(state.numpy() if isinstance(state, Tensor) else state)
        if values.shape != (2,) or values.dtype != np.int64:
            raise ValueError(
                f"set_state: a generator state is an int64 tensor of shape [2] (seed, offset), "
                f"got {values.dtype}{list(values.shape)} [at {format_site(user_site())}]"
            )
        if values[1] < 0:
            raise ValueError(f"set_state: the offset must be >= 0, got {int(values[1])}")
        with self._lock:
            self._seed = int(values[0]) & ((1 << 64) - 1)
            self._offset = int(values[1])
        return self

    def __repr__(self) -> str:
        return f"flame.Generator(seed={self._seed}, offset={self._offset})"

    # --- what draws use --------------------------------------------------------------------
    def _take(self, count: int) -> int:
        """Reserve ``count`` counters; the offset of the first."""
        with self._lock:
            offset = self._offset
            self._offset = offset + count
        return offset

    def _state_storage(self, backend: str):
        """The state buffer compiled programs read: one per backend, at a fixed address."""
        storage = self._states.get(backend)
        if storage is None:
            from flame.runtime.storage import Storage

            values = np.zeros(2, dtype=_INT64)
            if backend == "reference":
                storage = Storage("reference", dtypes.int64, array=values)
            else:
                import cupy

                storage = Storage("cuda", dtypes.int64, array=cupy.asarray(values))
            self._states[backend] = storage
        return storage

    def _advance_for_call(self, backend: str, count: int) -> None:
        """Before a compiled program's call: its state buffer holds (seed, offset), and the
        offset moves past the program's ``count`` numbers."""
        offset = self._take(count)
        storage = self._state_storage(backend)
        if backend == "reference":
            storage.array[...] = (_as_int64(self._seed), offset)
        else:
            _state_uploads().write(_as_int64(self._seed), offset, storage.array.data.ptr)


default_generator = Generator()

_staged = None


def _uploads():
    global _staged  # one ring of page-locked buffers for the process, made at first use
    if _staged is None:
        from flame.runtime.staging import StagedUploads

        _staged = StagedUploads(slots=16)
    return _staged


class _StateUploads:
    """Copies of a generator's (seed, offset) into its state buffer, one per compiled call:
    each from its own 16 bytes of one page-locked ring, queued with one driver call on the
    current stream, so the host neither waits nor allocates. A chunk of the ring is written
    again only after the event recorded at the end of its last round has passed."""

    SLOTS = 4096
    CHUNK = 256

    def __init__(self):
        import cupy

        self._cupy = cupy
        self._memory = cupy.cuda.alloc_pinned_memory(self.SLOTS * 16)
        self._values = np.frombuffer(self._memory, dtype=_INT64, count=self.SLOTS * 2)
        self._address = self._memory.ptr
        self._events: list = [None] * (self.SLOTS // self.CHUNK)
        self._next = 0
        self._lock = threading.Lock()

    def write(self, seed: int, offset: int, target: int) -> None:
        cupy = self._cupy
        with self._lock:
            slot = self._next
            self._next = (slot + 1) % self.SLOTS
            chunk, place = divmod(slot, self.CHUNK)
            if place == 0 and self._events[chunk] is not None:
                self._events[chunk].synchronize()  # that round's copies have run
            values = self._values
            values[2 * slot] = seed
            values[2 * slot + 1] = offset
            stream = cupy.cuda.get_current_stream()
            cupy.cuda.runtime.memcpyAsync(
                target, self._address + 16 * slot, 16, cupy.cuda.runtime.memcpyHostToDevice,
                stream.ptr,
            )  # fmt: skip
            if place == self.CHUNK - 1:
                self._events[chunk] = stream.record()


_state_ring = None


def _state_uploads() -> _StateUploads:
    global _state_ring  # one ring for the process, made at the first compiled call that draws
    if _state_ring is None:
        _state_ring = _StateUploads()
    return _state_ring


_StagedStorage = None


def _staged_storage():
    """``Storage`` of host values that goes to the GPU through the page-locked staging ring
    (no host wait) when a kernel first reads it."""
    global _StagedStorage  # a class, made once
    if _StagedStorage is None:
        from flame.runtime.storage import Storage

        class StagedStorage(Storage):
            __slots__ = ()

            def __init__(self, values):
                super().__init__("cuda", dtypes.int64, host=values)

            def device_array(self):
                if self.array is None:
                    self.array = _uploads().put(self.host)
                return self.array

        _StagedStorage = StagedStorage
    return _StagedStorage


def manual_seed(seed) -> Generator:
    """Seed the default generator (PyTorch's ``torch.manual_seed``)."""
    return default_generator.manual_seed(seed)


def seed() -> int:
    return default_generator.seed()


def initial_seed() -> int:
    return default_generator.initial_seed()


def get_rng_state() -> Tensor:
    return default_generator.get_state()


def set_rng_state(state) -> None:
    default_generator.set_state(state)


def _generator(generator) -> Generator:
    if generator is None:
        return default_generator
    if not isinstance(generator, Generator):
        raise TypeError(f"generator must be a flame.Generator, got {type(generator).__name__}")
    return generator


# --- the bits of a draw ------------------------------------------------------------------------


def _key(generator: Generator, count: int, backend: str) -> tuple[Tensor, Tensor | int]:
    """(the state tensor [seed, offset], the draw's offset added to the state's)."""
    from flame.compile import current_trace
    from flame.runtime.storage import Storage

    trace = current_trace()
    if trace is not None:  # read at every call; the program advances the generator
        storage = generator._state_storage(backend)
        local = trace.note_draw(generator, count)
    else:
        offset = generator._take(count)
        values = np.array([_as_int64(generator._seed), offset], dtype=_INT64)
        if backend == "reference":
            storage = Storage("reference", dtypes.int64, array=values)
        else:  # copied to the GPU when a kernel first reads it (building touches no GPU)
            storage = _staged_storage()(values)
        local = 0
    node = Node("buffer", (), (("storage", storage),), dtypes.int64, (2,), user_site())
    return Tensor(node, backend), local


def state_operand(count: int, backend: str, generator=None) -> Tensor:
    """The int64 [2] (seed, offset) of a draw of ``count`` counters, for a fused op that
    draws inside its own kernels (attention's dropout): as a draw of its own, lazy or
    compiled (a compiled program reads the generator's state buffer at every call)."""
    from flame.backend import backend as use_backend
    from flame.creation import tensor

    state, local = _key(_generator(generator), count, backend)
    if not local:
        return state
    with use_backend(backend):
        return state + tensor(np.array([0, local], dtype=_INT64))


def random_bits(shape, generator=None, words: int = 1) -> list[Tensor]:
    """``words`` int64 tensors of ``shape`` holding 24 random bits each (Philox words 0..)."""
    from flame.creation import arange
    from flame.views import expand, reshape

    generator = _generator(generator)
    backend = get_backend()
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    state, local = _key(generator, count, backend)
    seed_value, offset = state[0], state[1]
    if local:
        offset = offset + local
    counter = reshape(arange(count, dtype=dtypes.int64), shape) + offset
    seed_value = expand(seed_value, tuple(shape))
    return [apply("philox", seed_value, counter, word=word) for word in range(words)]


def uniform_bits_to_float(bits: Tensor) -> Tensor:
    """[0, 1) from 24 random bits, exactly as ``flame_uniform`` computes it."""
    return bits.to(dtypes.float32) * (1.0 / (1 << 24))


def draw_uniform(shape, generator=None) -> Tensor:
    return uniform_bits_to_float(random_bits(shape, generator)[0])


def draw_normal(shape, generator=None) -> Tensor:
    """Box-Muller on two words, as ``flame_randn``."""
    first, second = random_bits(shape, generator, words=2)
    radius_source = uniform_bits_to_float(first) + (1.0 / (1 << 24))
    angle = uniform_bits_to_float(second) * 6.283185307179586
    return (radius_source.log() * -2.0).sqrt() * angle.cos()


def host_rng(generator, count: int, what: str) -> np.random.Generator:
    """A NumPy generator for draws FLAME makes on the host (``randperm``, ``multinomial``),
    keyed by the generator's seed and counter, which it advances by ``count``."""
    from flame.compile import current_trace

    if current_trace() is not None:
        from flame.compile import TraceError

        raise TraceError(
            f"{what} inside a function being compiled [at {format_site(user_site())}]: it is "
            "drawn on the host; draw it outside and pass it in as an argument"
        )
    generator = _generator(generator)
    offset = generator._take(count)
    bit_generator = np.random.Philox(key=generator._seed, counter=offset)
    return np.random.Generator(bit_generator)


def snapshot() -> list[tuple]:
    """Where every live generator stands (lazy offsets and the current trace's draws), for
    a checkpoint's recomputation to draw the same numbers again."""
    from flame.compile import current_trace

    trace = current_trace()
    local = dict(trace.draws) if trace is not None else {}
    return [(generator, generator._offset, local.get(generator)) for generator in _generators]


def rewind(positions: list[tuple]) -> list[tuple]:
    """Put the generators back to ``positions``; returns where they stood before."""
    from flame.compile import current_trace

    now = snapshot()
    trace = current_trace()
    for generator, offset, local in positions:
        with generator._lock:
            generator._offset = offset
        if trace is not None:
            if local is None:
                trace.draws.pop(generator, None)
            else:
                trace.draws[generator] = local
    return now
