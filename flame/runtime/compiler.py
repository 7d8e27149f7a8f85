"""NVRTC compilation with an in-memory and an on-disk cache.

A compiled kernel is keyed by its code (rendered source without the leading comment), the
target arch, the NVRTC version, the options and FLAME's version: the cubin on disk is reused
by any process whose compile would produce the same bytes.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
import time

from flame._version import __version__
from flame.codegen.render import code_key
from flame.records import Record, field
from flame.runtime import events
from flame.runtime.cache import DiskCache
from flame.runtime.device import target_arch

OPTIONS = ("-std=c++17",)


class KernelCompileError(RuntimeError):
    """NVRTC rejected a generated kernel: the message names it and holds its log and source."""

    def __init__(self, name: str, log: str, source: str):
        numbered = "\n".join(
            f"{number:4d}  {line}" for number, line in enumerate(source.splitlines(), 1)
        )
        super().__init__(
            f"NVRTC failed to compile kernel {name}:\n{log}\n--- source ---\n{numbered}"
        )
        self.kernel_name, self.log, self.source = name, log, source


@functools.lru_cache(maxsize=1)
def nvrtc_version() -> str:
    """Part of every kernel's cache key; reading it loads NVRTC (6-16 ms on the H100 host), once
    per process. Loading it in a background thread while the planner imports made a warm
    start's first result slower, 15.7 -> 18.2 ms median (the threads traded the GIL)."""
    from cupy.cuda import nvrtc

    major, minor = nvrtc.getVersion()
    return f"{major}.{minor}"


def nvrtc_compile(source: str, name: str, arch: str, options=OPTIONS) -> bytes:
    """Compile CUDA C to a cubin for ``arch``. Needs only the NVRTC library, not a GPU."""
    from cupy.cuda import nvrtc

    program = nvrtc.createProgram(source, f"{name}.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(program, [f"--gpu-architecture={arch}", *options])
        except nvrtc.NVRTCError:
            raise KernelCompileError(name, nvrtc.getProgramLog(program), source) from None
        return bytes(nvrtc.getCUBIN(program))
    finally:
        nvrtc.destroyProgram(program)


class CacheStats(Record):
    """What a KernelCache did: hits by level, compiles and their time, one event per kernel."""

    memory_hits: int = 0
    disk_hits: int = 0
    compiles: int = 0
    compile_seconds: float = 0.0
    background: int = 0  # kernels compiled or loaded ahead of need (other size classes)
    events: list = field(default_factory=list)  # (kernel name, "memory"|"disk"|"compiled", seconds)


_loads: contextvars.ContextVar = contextvars.ContextVar("flame_kernel_loads", default=None)


@contextlib.contextmanager
def kernel_loads():
    """Collects, into the list it yields, one dict per kernel the code inside loads from the
    disk cache or compiles with NVRTC: ``kernel``, ``origin`` ("disk" | "compiled"),
    ``reason`` (``flame.codegen.explain``: what changed) and ``size_class``."""
    found: list = []
    token = _loads.set(found)
    try:
        yield found
    finally:
        _loads.reset(token)


class KernelCache:
    """cubins by content key: memory first, then disk, then NVRTC. Thread-safe."""

    def __init__(self, disk: DiskCache | None = None, arch: str | None = None):
        self.disk = disk if disk is not None else DiskCache()
        self.arch = arch
        self.stats = CacheStats()
        self._cubins: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._last_spec: dict[str, object] = {}  # name stem -> last spec loaded (explanations)

    def key(self, code: str) -> str:
        """``code``: the rendered source, or a key that stands for it (``spec_key``)."""
        arch = self.arch or target_arch()
        identity = code_key(code) if "\n" in code else code
        return DiskCache.key(identity, arch, nvrtc_version(), " ".join(OPTIONS), __version__)

    def cubin(
        self, source, name: str, code_identity: str | None = None, spec=None,
        background: bool = False,
    ) -> tuple[str, bytes]:  # fmt: skip
        """The cubin for ``source`` (a string, or a function that renders it only when it
        must be compiled); ``code_identity`` keys it without rendering; ``spec`` (the
        KernelSpec) explains a load that is not a memory hit (``kernel_loads``).
        ``background``: work ahead of need (flame/runtime/siblings.py), counted apart in
        ``stats.background`` so a plan's own compiles stay countable."""
        key = self.key(code_identity if code_identity is not None else self._text(source))
        with self._lock:
            cached = self._cubins.get(key)
            if cached is not None and not background:
                self.stats.memory_hits += 1
        if cached is not None and background:
            return key, cached
        if cached is not None:
            if events.active():
                events.emit(
                    "kernel",
                    name=name,
                    origin="memory",
                    seconds=0.0,
                    key=key,
                    source=lambda: self._text(source),
                )
            return key, cached
        start = time.perf_counter()
        data = self.disk.get(key)
        origin = "disk"
        if data is None:
            data = nvrtc_compile(self._text(source), name, self.arch or target_arch())
            self.disk.put(key, data)
            origin = "compiled"
        elapsed = time.perf_counter() - start
        reason = self._explain(spec, name, origin) if spec is not None else ""
        with self._lock:
            self._cubins[key] = data
            if background:
                self.stats.background += 1
                return key, data
            if origin == "disk":
                self.stats.disk_hits += 1
            else:
                self.stats.compiles += 1
                self.stats.compile_seconds += elapsed
            self.stats.events.append((name, origin, elapsed))
        if events.active():
            events.emit(
                "kernel",
                name=name,
                origin=origin,
                seconds=elapsed,
                key=key,
                source=lambda: self._text(source),
                reason=reason,
            )
        return key, data

    def _explain(self, spec, name: str, origin: str) -> str:
        from flame.codegen.explain import compile_reason, stem

        with self._lock:
            reason = compile_reason(spec, self._last_spec.get(stem(name)))
            self._last_spec[stem(name)] = spec
        found = _loads.get()
        if found is not None:
            found.append({"kernel": name, "origin": origin, "reason": reason,
                          "size_class": spec.size_class})  # fmt: skip
        return reason

    @staticmethod
    def _text(source) -> str:
        return source() if callable(source) else source

    def cubins(self, sources_and_names) -> list[tuple[str, bytes]]:
        """Several kernels at once, items as ``cubin``'s arguments. NVRTC releases the GIL, so
        kernels compile in threads, one a CPU (``compile_threads``); each distinct kernel once
        (a plan names one kernel in many groups: the UNet's step 1267 loads, 268 kernels; two
        threads used to compile the same one side by side), the biggest first, so that the
        longest compile does not start last. The repeats are then memory hits, as they would
        be one after the other."""
        items = list(sources_and_names)
        if len(items) <= 1:
            return [self.cubin(*item) for item in items]
        first: dict[str, int] = {}
        for index, item in enumerate(items):
            identity = item[2] if len(item) > 2 and item[2] is not None else None
            if identity is None:  # no cheap key: rendered here, once
                text = self._text(item[0])
                item = (text, *item[1:])
                items[index] = item
                identity = text
            first.setdefault(self.key(identity), index)
        unique = sorted(first.values(), key=lambda index: -_size_estimate(items[index]))
        results: list = [None] * len(items)
        from concurrent.futures import ThreadPoolExecutor  # imports logging: not at start-up

        context = contextvars.copy_context()  # the workers report to this context's recorders
        with ThreadPoolExecutor(max_workers=min(compile_threads(), len(unique))) as pool:
            done = pool.map(lambda i: context.copy().run(self.cubin, *items[i]), unique)
            for index, result in zip(unique, done):
                results[index] = result
        return [
            result if result is not None else self.cubin(*item)
            for result, item in zip(results, items)
        ]


def compile_threads() -> int:
    """Threads that run NVRTC at once: ``FLAME_COMPILE_THREADS``, else one a CPU this
    process may use (at least 2, at most 32)."""
    import os

    explicit = os.environ.get("FLAME_COMPILE_THREADS", "")
    if explicit.isdigit() and int(explicit) > 0:
        return int(explicit)
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 8
    return max(2, min(32, cpus))


def _size_estimate(item) -> int:
    """How big a kernel's code is (its compile time follows): from its spec's lines, else
    the source's length."""
    spec = item[3] if len(item) > 3 else None
    if spec is not None:
        lines = (spec.header, spec.setup, spec.prologue, spec.body, spec.epilogue)
        return sum(len(part) for part in lines) * 80
    return len(item[0]) if isinstance(item[0], str) else 0


_default_cache: KernelCache | None = None
_default_lock = threading.Lock()


def default_kernel_cache() -> KernelCache:
    """The process's kernel cache (content-addressed, so sharing it cannot mix results)."""
    global _default_cache
    with _default_lock:
        if _default_cache is None:
            _default_cache = KernelCache()
        return _default_cache
