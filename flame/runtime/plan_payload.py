"""The plan store's payload (flame/runtime/plan_store.py): a planned graph written as a
node table in topological order (inputs by integer position: no recursion, whatever the
depth), its groups and save-or-recompute decision, the kernel specs with their
``spec_key``\\ s, the launch arguments, the library calls (a collective's pending slot) and
the joins of collectives run on the communication stream, slot numbering, releases and
planned peak; and read back by an unpickler that accepts only FLAME's, NumPy's and a few
builtin classes."""

from __future__ import annotations

import functools
import io
import math
import pickle
import time

from flame.ir.graph import Graph, Group, Remat
from flame.ir.node import Node, Token, toposort

FORMAT = 3  # 3: collectives on the communication stream (a pending slot, joins)


class Unstorable(Exception):
    """A plan (or key) holds something the store does not write: it is simply not stored."""


def is_recompute(value) -> bool:
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
    from flame.runtime.executor import CollectiveJoin, LibraryCall

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
            node = index[id(step.node)]
            launches.append(("library", node, step.inputs, step.output, step.views, step.pending))
        elif isinstance(step, CollectiveJoin):
            launches.append(("join", index[id(step.node)], step.pending, step.inputs))
        else:
            launches.append((
                "kernel", specs.index(step.spec), step.grid, step.block, step.args,
                step.writes, step.shapes, step.zeroed, step.shared_bytes,
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


def valid(payload, digest: str, inputs) -> bool:
    return (
        type(payload) is dict
        and payload.get("format") == FORMAT
        and payload.get("digest") == digest
        and payload.get("signature") == _signature(inputs)
    )


def decode(payload: dict, load_functions, start: float):
    from flame.codegen.render import render
    from flame.codegen.spec import KernelSpec
    from flame.runtime.executor import CollectiveJoin, LibraryCall, Plan
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
            _, node, call_inputs, output, views, pending = entry
            launches.append(LibraryCall(nodes[node], call_inputs, output, views, pending))
        elif entry[0] == "join":
            _, node, pending, call_inputs = entry
            launches.append(CollectiveJoin(nodes[node], pending, call_inputs))
        else:
            _, spec, grid, block, args, writes, shapes, zeroed, shared = entry
            function = functions[code_of[spec]]
            launches.append(
                Launch(specs[spec], function, grid, block, args, writes, shapes, zeroed, shared)
            )
    slot_count, output_slots, releases, peak = payload["slots"]
    steps = [step for step in launches if not isinstance(step, CollectiveJoin)]
    if len(releases) != len(launches) or len(groups) != len(steps):
        raise Unstorable("launches, groups and releases disagree")
    seconds = time.perf_counter() - start
    return Plan(
        tuple(launches), slot_count, output_slots, graph, seconds, releases, peak,
        at(payload["inputs"]),
    )  # fmt: skip


def _stored_attrs(attrs: tuple) -> tuple:
    return tuple(
        (name, StoredRecompute(repr(value)) if is_recompute(value) else value)
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
     ("flame.runtime.plan_payload", "StoredRecompute")}
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


class SafeUnpickler(pickle.Unpickler):
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
