"""Planned graphs on disk: a new process that builds a graph planned before loads the plan
instead of running the passes, the lowering and the memory planning again (issue 22: the
UNet step's first call from a warm disk cache spent ~30 s of the CPU probe in them).

An entry sits in the kernel cache's directory (``DiskCache``: atomic writes, a checksum,
corrupt files removed; ``flame cache list|clear`` sees and removes plans with the kernels)
under a key that is the sha256 of:

- the plan key ``linearize`` gives (ops, attributes, sharing, inputs' types and layouts;
  the executor prefixes the deterministic mode), pickled without a memo, so that the bytes
  depend on values, never on which objects happen to be shared; ``Token``\\ s (unique
  attributes) are numbered by their first appearance;
- FLAME's own sources (every ``flame/**/*.py`` and template), so that any change to the
  passes or the code generator makes old entries unreachable;
- the target arch and multiprocessor count (launch grids), ``FLAME_VERIFY``, Python's and
  NumPy's versions (the payload is a pickle).

The payload holds the post-pass graph as a node table in topological order (inputs by
integer position: no recursion, whatever the depth), its groups and save-or-recompute
decision, the kernel specs with their ``spec_key``\\ s (the functions come from the kernel
cache by key, so nothing is lowered or rendered), the launch arguments, slot numbering,
releases and planned peak. A load checks the format, the key and the new call's input
signature, and accepts only FLAME's, NumPy's and a few builtin classes from the pickle:
anything off is a miss (and the entry is rewritten by the next plan), never an error or a
wrong plan.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import io
import math
import os
import pickle
import sys
import time

from flame.ir.graph import Graph, Group, Remat
from flame.ir.node import Node, Token, toposort
from flame.runtime.cache import DiskCache

FORMAT = 2
# A plan built faster than this is not worth a file (lazy mode builds many small plans).
MIN_PLAN_SECONDS = 0.02
# Graphs of fewer nodes are never looked up: they plan in milliseconds, and a new process's
# first lazy result must not pay for hashing FLAME's sources (~30 ms, once).
MIN_NODES = 64


class Unstorable(Exception):
    """A plan (or key) holds something the store does not write: it is simply not stored."""


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
                payload = _SafeUnpickler(io.BytesIO(data)).load()
                if not _valid(payload, digest, inputs):
                    raise Unstorable("another format, key or input signature")
                plan = _decode(payload, load_functions, start)
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


def _is_recompute(value) -> bool:
    """A checkpoint node's ``recompute`` attribute (flame/recompute.py: the region's
    function, arguments and nodes, for autograd)."""
    kind = type(value)
    return kind.__name__ == "Recompute" and kind.__module__ == "flame.recompute"


class StoredRecompute:
    """A checkpoint's ``recompute`` attribute in a plan loaded from disk: its printed form.
    The plan does not depend on it (the recomputed region is already explicit in the graph,
    behind barriers), and a plan's graph is never differentiated again."""

    __slots__ = ("text",)

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


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
        if _is_recompute(value):  # the same for every checkpoint: the plan ignores it
            return _key_token, ("recompute",)
        return NotImplemented


def _key_bytes(value) -> bytes:
    buffer = io.BytesIO()
    _KeyPickler(buffer).dump(value)
    return buffer.getvalue()


# -- the payload ----------------------------------------------------------------------------


def _signature(inputs) -> tuple:
    """What a plan assumes of its inputs: backend, dtype, shape and memory layout."""
    found = []
    for node in inputs:
        storage = node.buffer if node.buffer is not None else node.attr("storage")
        found.append((storage.backend, node.dtype.name, node.shape, storage.layout()))
    return tuple(found)


class _PayloadPickler(pickle.Pickler):
    """Writes only what ``_SafeUnpickler`` reads back: plain builtins, FLAME's few plan
    classes, NumPy scalars, dtypes and arrays; a node outside the node table, or any other
    object, makes the plan unstorable."""

    def reducer_override(self, value):
        kind = type(value)
        if kind in _stored_classes() or isinstance(value, _numpy_instances()):
            return NotImplemented
        module, name = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
        if isinstance(module, str) and isinstance(name, str) and _allowed(module, name, value):
            return NotImplemented  # a class or function by name: one the unpickler takes
        raise Unstorable(f"a {kind.__module__}.{kind.__qualname__} in the plan")


@functools.lru_cache(maxsize=1)
def _stored_classes() -> frozenset:
    from flame.codegen.spec import Arg, KernelSpec
    from flame.ir.dtypes import DType
    from flame.ir.infer import SizeValue
    from flame.ir.views import View
    from flame.runtime.storage import PlannedInput

    return frozenset(
        {DType, PlannedInput, KernelSpec, Arg, View, SizeValue, Token, StoredRecompute}
    )


def _numpy_type(value) -> bool:
    import numpy

    return isinstance(value, type) and issubclass(value, (numpy.generic, numpy.dtype))


def encode(plan, digest: str, inputs: list[Node]) -> bytes:
    """``plan`` as the bytes ``load`` reads."""
    from flame.runtime.executor import LibraryCall

    graph = plan.graph
    remat = graph.remat
    roots = [*graph.outputs, *plan.inputs]
    for group in graph.groups:
        roots += [*group.nodes, *group.outputs]
    roots += [step.node for step in plan.launches if isinstance(step, LibraryCall)]
    if remat is not None:
        roots += [entry[0] for entry in (*remat.saved, *remat.recomputed)]
    nodes = toposort(roots)
    index = {id(node): position for position, node in enumerate(nodes)}
    table = [
        (node.op, tuple([index[id(child)] for child in node.inputs]),
         _stored_attrs(node.attrs) if node.op == "checkpoint" else node.attrs,
         node.dtype, node.shape, node.site)
        for node in nodes
    ]  # fmt: skip

    def refs(values) -> tuple:
        return tuple([index[id(node)] for node in values])

    specs = _Specs()
    launches = []
    for step in plan.launches:
        if isinstance(step, LibraryCall):
            launches.append(("library", index[id(step.node)], step.inputs, step.output, step.views))
        else:
            launches.append((
                "kernel", specs.index(step.spec), step.grid, step.block, step.args,
                step.writes, step.shapes, step.zeroed,
            ))  # fmt: skip
    if remat is not None:
        saved = tuple((index[id(node)], *rest) for node, *rest in remat.saved)
        recomputed = tuple((index[id(node)], *rest) for node, *rest in remat.recomputed)
        remat = (saved, recomputed, remat.without, remat.with_saves, remat.kept)
    payload = {
        "format": FORMAT,
        "digest": digest,
        "signature": _signature(inputs),
        "nodes": table,
        # nodes whose attributes hold a NaN (made the one ``infer.NAN`` again on load)
        "nans": [number for number, node in enumerate(nodes) if _has_nan(node.attrs)],
        "graph": (graph.name, refs(graph.outputs), remat),
        "groups": [
            (group.kind, refs(group.nodes), refs(group.outputs), group.reasons)
            for group in graph.groups
        ],
        "inputs": refs(plan.inputs),
        "codes": specs.codes,
        "specs": specs.specs,
        "launches": launches,
        "slots": (plan.slot_count, plan.output_slots, plan.releases, plan.planned_peak_bytes),
    }
    buffer = io.BytesIO()
    _PayloadPickler(buffer, protocol=5).dump(payload)
    return buffer.getvalue()


class _Specs:
    """A plan's kernel specs, each distinct one once (a kernel launched in many groups has
    one spec per launch, equal but not shared; the UNet step: 1371 launches, 556 specs),
    and the code of specs that differ only in their comment header and planned sizes once
    per ``spec_key`` (279): ``codes`` holds (key, fields but header and params), ``specs``
    (code, header, params)."""

    def __init__(self):
        self.codes: list[tuple] = []
        self.specs: list[tuple] = []
        self._codes_of: dict[str, list[int]] = {}
        self._index: dict[tuple, int] = {}

    def index(self, spec) -> int:
        from flame.codegen.render import spec_key
        from flame.records import fields

        key = spec_key(spec)
        code = {
            field.name: getattr(spec, field.name) for field in fields(spec)
            if field.name not in ("header", "params")
        }  # fmt: skip
        known = self._codes_of.setdefault(key, [])
        found = next((number for number in known if self.codes[number][1] == code), None)
        if found is None:  # a key's code differs only if its repr collides: kept apart
            found = len(self.codes)
            self.codes.append((key, code))
            known.append(found)
        identity = (found, spec.header, spec.params)
        number = self._index.get(identity)
        if number is None:
            number = self._index[identity] = len(self.specs)
            self.specs.append(identity)
        return number


def _valid(payload, digest: str, inputs) -> bool:
    return (
        type(payload) is dict
        and payload.get("format") == FORMAT
        and payload.get("digest") == digest
        and payload.get("signature") == _signature(inputs)
    )


def _decode(payload: dict, load_functions, start: float):
    from flame.codegen.render import render
    from flame.codegen.spec import KernelSpec
    from flame.runtime.executor import LibraryCall, Plan
    from flame.runtime.launch import Launch

    table = payload["nodes"]
    for number in payload["nans"]:
        op, children, attrs, dtype, shape, site = table[number]
        table[number] = (op, children, _canonical(attrs), dtype, shape, site)
    nodes: list[Node] = []
    for op, children, attrs, dtype, shape, site in table:
        inputs = tuple([nodes[child] for child in children])
        nodes.append(Node(op, inputs, attrs, dtype, shape, site))

    def at(refs) -> tuple:
        return tuple([nodes[ref] for ref in refs])

    name, outputs, remat = payload["graph"]
    if remat is not None:
        saved, recomputed, without, with_saves, kept = remat
        saved = tuple((nodes[ref], *rest) for ref, *rest in saved)
        recomputed = tuple((nodes[ref], *rest) for ref, *rest in recomputed)
        remat = Remat(saved, recomputed, without, with_saves, kept)
    groups = tuple(
        Group(kind, at(members), at(written), reasons)
        for kind, members, written, reasons in payload["groups"]
    )  # fmt: skip
    graph = Graph(at(outputs), name, groups, remat)
    codes = payload["codes"]
    specs = [KernelSpec(**codes[code][1], header=header, params=params)
             for code, header, params in payload["specs"]]  # fmt: skip
    # each kernel asked for once (the UNet step: 1,371 launches of 279 kernels): launches
    # of one code share its function, as the executor's loads by key would give them
    code_of = [code for code, _, _ in payload["specs"]]
    first_spec: dict[int, int] = {}
    for entry in payload["launches"]:
        if entry[0] == "kernel":
            first_spec.setdefault(code_of[entry[1]], entry[1])
    sources = [
        (functools.partial(render, specs[spec]), specs[spec].name, codes[code][0], specs[spec])
        for code, spec in first_spec.items()
    ]  # fmt: skip
    functions = dict(zip(first_spec, load_functions(sources) if sources else ()))
    launches = []
    for entry in payload["launches"]:
        if entry[0] == "library":
            _, node, call_inputs, output, views = entry
            launches.append(LibraryCall(nodes[node], call_inputs, output, views))
        else:
            _, spec, grid, block, args, writes, shapes, zeroed = entry
            function = functions[code_of[spec]]
            launches.append(
                Launch(specs[spec], function, grid, block, args, writes, shapes, zeroed)
            )
    slot_count, output_slots, releases, peak = payload["slots"]
    if len(releases) != len(launches) or len(groups) != len(launches):
        raise Unstorable("launches, groups and releases disagree")
    seconds = time.perf_counter() - start
    return Plan(
        tuple(launches), slot_count, output_slots, graph, seconds, releases, peak,
        at(payload["inputs"]),
    )  # fmt: skip


def _stored_attrs(attrs: tuple) -> tuple:
    return tuple(
        (name, StoredRecompute(repr(value)) if _is_recompute(value) else value)
        for name, value in attrs
    )  # fmt: skip


def _has_nan(value) -> bool:
    kind = type(value)
    if kind is float:
        return math.isnan(value)
    return kind is tuple and any(_has_nan(item) for item in value)


def _canonical(value):
    """``value`` as the graph builders make it: every NaN float the one ``infer.NAN`` object
    (attributes hash by value, and a NaN's hash is its identity)."""
    kind = type(value)
    if kind is float and math.isnan(value):
        from flame.ir.infer import NAN

        return NAN
    if kind is tuple:
        items = [_canonical(item) for item in value]
        if any(item is not old for item, old in zip(items, value)):
            return tuple(items)
    return value


_BUILTINS = frozenset(
    {"bool", "int", "float", "complex", "str", "bytes", "tuple", "list", "dict", "set",
     "frozenset", "slice", "bytearray"}
)  # fmt: skip
# (module, name) of FLAME's classes and functions a payload names (``_stored_classes``)
_FLAME_GLOBALS = frozenset(
    {("flame.ir.dtypes", "dtype"), ("flame.runtime.storage", "PlannedInput"),
     ("flame.codegen.spec", "KernelSpec"), ("flame.codegen.spec", "Arg"),
     ("flame.ir.views", "View"), ("flame.ir.infer", "SizeValue"), ("flame.ir.node", "Token"),
     ("flame.runtime.plan_store", "StoredRecompute")}
)  # fmt: skip
_NUMPY_GLOBALS = frozenset({"scalar", "dtype", "ndarray", "_reconstruct"})


def _numpy_instances() -> tuple:
    import numpy

    return (numpy.generic, numpy.dtype, numpy.ndarray)


def _allowed(module: str, name: str, value) -> bool:
    """Whether a payload may name ``module.name`` (``value``, what it is)."""
    if "." in name:  # a dotted name reaches through attributes
        return False
    if module == "builtins":
        return name in _BUILTINS
    if module.split(".")[0] in ("numpy", "ml_dtypes"):
        return name in _NUMPY_GLOBALS or _numpy_type(value)
    return (module, name) in _FLAME_GLOBALS


class _SafeUnpickler(pickle.Unpickler):
    """Loads only what ``_PayloadPickler`` writes: a file in the cache directory cannot
    name other code to run."""

    def find_class(self, module: str, name: str):
        if "." not in name and (
            module == "builtins" or (module, name) in _FLAME_GLOBALS
            or module.split(".")[0] in ("numpy", "ml_dtypes")
        ):  # fmt: skip
            found = super().find_class(module, name)
            if _allowed(module, name, found):
                return found
        raise pickle.UnpicklingError(f"the plan store refuses {module}.{name}")
