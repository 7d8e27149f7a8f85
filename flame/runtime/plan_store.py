"""Planned graphs on disk: a new process that builds a graph planned before loads the plan
instead of running the passes, the lowering and the memory planning again (issue 22: the
UNet step's first call from a warm disk cache spent ~30 s of the CPU probe in them).

An entry sits in the kernel cache's directory (``DiskCache``: atomic writes, a checksum,
corrupt files removed; ``flame cache list|clear`` sees and removes plans with the kernels)
under a key that is the sha256 of:

- the plan key ``linearize`` gives (ops, attributes, sharing, inputs' types and layouts;
  the executor prefixes the deterministic mode, and ``plans.OVERLAP_COLLECTIVES`` when it is
  off), pickled without a memo, so that the bytes depend on values, never on which objects
  happen to be shared; ``Token``\\ s (unique attributes) are numbered by their first
  appearance;
- FLAME's own sources (every ``flame/**/*.py`` and template), so that any change to the
  passes or the code generator makes old entries unreachable;
- the target arch and multiprocessor count (launch grids), ``FLAME_VERIFY``, Python's and
  NumPy's versions (the payload is a pickle).

The payload (flame/runtime/plan_payload.py) holds the post-pass graph as a node table in
topological order (inputs by integer position: no recursion, whatever the depth), its
groups and save-or-recompute decision, the kernel specs with their ``spec_key``\\ s (the
functions come from the kernel cache by key, so nothing is lowered or rendered), the launch
arguments, slot numbering, releases and planned peak. A load checks the format, the key and
the new call's input signature, and accepts only FLAME's, NumPy's and a few builtin classes
from the pickle: anything off is a miss (and the entry is rewritten by the next plan), never
an error or a wrong plan.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import io
import os
import pickle
import sys
import time

from flame.ir.node import Node, Token
from flame.runtime.cache import DiskCache
from flame.runtime.plan_payload import (
    FORMAT,
    SafeUnpickler,
    Unstorable,
    decode,
    encode,
    is_recompute,
    valid,
)

# A plan built faster than this is not worth a file (lazy mode builds many small plans).
MIN_PLAN_SECONDS = 0.02
# Graphs of fewer nodes are never looked up: they plan in milliseconds, and a new process's
# first lazy result must not pay for hashing FLAME's sources (~30 ms, once).
MIN_NODES = 64


def enabled() -> bool:
    """``FLAME_PLAN_CACHE=0`` turns the plan store off (read at each plan miss)."""
    return os.environ.get("FLAME_PLAN_CACHE", "1") != "0"


class PlanStore:
    """Plans on disk, beside the kernels of ``disk`` (its directory). ``source_digest``
    defaults to the hash of FLAME's sources; ``min_seconds`` is the least planning time
    worth storing."""

    def __init__(
        self, disk: DiskCache, source_digest: str | None = None,
        min_seconds: float = MIN_PLAN_SECONDS,
    ):  # fmt: skip
        self.disk = DiskCache(disk.root)  # the same files, counters of its own
        self.source_digest = source_digest
        self.min_seconds = min_seconds
        self.min_nodes = MIN_NODES
        self.hits = 0
        self.misses = 0
        self.rejected = 0  # entries found but refused (corrupt, stale, another signature)
        self.writes = 0
        self.unstorable = ""  # why the last plan not stored was refused (diagnosis)

    def digest(self, key: tuple, arch: str) -> str | None:
        """The disk key of a plan key (the executor's: ``linearize``'s, or
        ``("deterministic", that)``), or None when the graph is too small to be worth it
        (``min_nodes``) or the key holds something without stable bytes: then the plan is
        neither looked up nor stored."""
        parts = key[1] if key[0] == "deterministic" else key
        if len(parts) - 1 < self.min_nodes:  # the last part lists the roots
            return None
        context = (
            FORMAT, self.source_digest or source_digest(), arch, _multiprocessors(),
            os.environ.get("FLAME_VERIFY", ""), sys.version_info[:2], _numpy_version(),
        )  # fmt: skip
        try:
            data = _key_bytes((context, key))
        except Exception:  # an attribute pickle refuses: no disk entry for this graph
            return None
        return hashlib.sha256(b"flame-plan\0" + data).hexdigest()

    def load(self, digest: str, inputs: list[Node], load_functions):
        """The stored plan for ``digest`` over ``inputs`` (the caller's graph inputs), its
        kernels' functions from ``load_functions(sources)`` (``Executor._load``); None on a
        miss."""
        start = time.perf_counter()
        data = self.disk.get(digest)
        if data is None:
            self.misses += 1
            return None
        try:
            with paused_collector():
                payload = SafeUnpickler(io.BytesIO(data)).load()
                if not valid(payload, digest, inputs):
                    raise Unstorable("another format, key or input signature")
                plan = decode(payload, load_functions, start)
        except Exception:  # corrupt or stale: a miss, and the next plan rewrites it
            self.rejected += 1
            self.misses += 1
            return None
        self.hits += 1
        return plan

    def save(self, digest: str, plan, inputs: list[Node]) -> bool:
        """Store ``plan`` (built over ``inputs``) under ``digest``; False when it is not
        stored (too quick to build, or holding what the store does not write)."""
        if plan.plan_seconds < self.min_seconds:
            return False
        try:
            data = encode(plan, digest, inputs)
        except Exception as error:
            self.unstorable = f"{type(error).__name__}: {error}"
            return False
        self.disk.put(digest, data)
        self.writes += 1
        return True


@contextlib.contextmanager
def paused_collector():
    """The cyclic garbage collector off inside (as it was before, after): building many
    objects that all stay alive (a loaded plan: ~0.5 M; a traced step's graph) set off
    collections that walked every object of the process, a full one among them each time
    (~0.4 s of the UNet step's first call from a warm disk on the CPU probe, half of the
    load). Objects freed by reference counting go as usual; cyclic garbage waits for the
    next collection after the block. Nesting and other threads' blocks: only the outermost
    block that found the collector on turns it on again. That block then moves the young
    objects (what it built, alive) to the oldest generation without scanning them
    (``gc.freeze`` + ``gc.unfreeze``; not where the process froze objects itself): the
    first young collection after the block scanned them all (~0.1 s here)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        if gc.get_freeze_count() == 0:  # nobody froze objects: none are unfrozen here
            gc.freeze()  # what the block built moves to the oldest generation unscanned
            gc.unfreeze()
        gc.enable()


# -- the key ------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """sha256 of FLAME's Python sources and templates (~30 ms, once per process)."""
    from flame.codegen.render import template_dir

    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    digest = hashlib.sha256()
    paths = []
    for folder, _, names in os.walk(package):
        paths += [os.path.join(folder, name) for name in names if name.endswith(".py")]
    templates = str(template_dir())
    paths += [os.path.join(templates, name) for name in os.listdir(templates)]
    for path in sorted(paths):
        with open(path, "rb") as file:
            data = file.read()
        name = os.path.relpath(path, os.path.dirname(package))
        digest.update(f"{name}\0{len(data)}\0".encode() + data)
    return digest.hexdigest()


def _multiprocessors():
    """The device's multiprocessor count (grids depend on it); None without a device."""
    from flame.runtime import launch

    try:
        return launch.device_info().multiprocessors  # the module's name: probes replace it
    except Exception:
        return None


def _numpy_version() -> str:
    import numpy

    return numpy.__version__


def _key_token(number):  # never called: the key's pickle is hashed, not loaded
    raise AssertionError("a plan key is never unpickled")


class _KeyPickler(pickle.Pickler):
    """Pickles a plan key without a memo (``fast``): equal values give equal bytes however
    they are shared; a ``Token`` becomes its number in order of appearance."""

    def __init__(self, file):
        super().__init__(file, protocol=5)
        self.fast = True
        self.tokens: dict[int, tuple] = {}

    def reducer_override(self, value):
        kind = type(value)
        if kind is Token:
            number = self.tokens.setdefault(id(value), (len(self.tokens), value))[0]
            return _key_token, (number,)
        if kind is Node:
            raise Unstorable("a node inside a plan key's attributes")
        if is_recompute(value):  # the same for every checkpoint: the plan ignores it
            return _key_token, ("recompute",)
        return NotImplemented


def _key_bytes(value) -> bytes:
    buffer = io.BytesIO()
    _KeyPickler(buffer).dump(value)
    return buffer.getvalue()
