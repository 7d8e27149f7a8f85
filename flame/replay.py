"""Replaying a prepared CUDA program: bind the arguments' memory, launch the plan (or its
captured CUDA graph), wrap the results as tensors. ``flame.compile`` traces and plans; this
module is the per-call path, so it does as little as it can.

Also here: how a function's result (nested tuples, lists and dicts of tensors) is flattened
to the program's outputs and rebuilt from them.
"""

from __future__ import annotations

import functools
import threading
import weakref

from flame.amp.autocast_mode import key as autocast_key
from flame.determinism import are_deterministic_algorithms_enabled
from flame.ir.node import Node
from flame.ir.ops.collective import COLLECTIVE_OPS
from flame.runtime import events, warmup
from flame.runtime.library_cudnn import plans_for_capture
from flame.runtime.storage import Storage, storage_of
from flame.signatures import exact_entry
from flame.tensor import Tensor

# A replay's result: a tensor over a buffer node over the Storage of the kernel's output.
# Every call of a compiled function makes one, so the three objects are made without their
# ``__init__`` calls, each slot set as the constructors set it (tests/test_host_cost.py checks
# them against ``Storage``, ``Node`` and ``Tensor``). The lines are shared by ``wrap`` and the
# generated runners, which inline them (names: new, Storage, Node, Tensor, dtype, shape, site).
STORAGE_LINES = (
    "storage = new(Storage)",
    "storage.backend = 'cuda'",
    "storage.dtype = dtype",
    "storage.array = {array}",
    "storage.host = storage._layout = None",
)
TENSOR_LINES = (
    "node = new(Node)",
    "node.op = 'buffer'",
    "node.inputs = ()",
    "node.attrs = (('storage', storage),)",
    "node.dtype = dtype",
    "node.shape = shape",
    "node.site = site",
    "node.buffer = node.grad_info = node._hash = None",
    "tensor = new(Tensor)",
    "tensor.node = node",
    "tensor.backend = storage.backend",
    "tensor.grad = None",
)
RESULT_NAMES = {"new": object.__new__, "Storage": Storage, "Node": Node, "Tensor": Tensor}


def result_lines(array: str) -> list[str]:
    """The body lines (indented once) that make ``tensor``, a replay's result over the CUDA
    array named ``array``."""
    return [f"    {line.format(array=array)}" for line in (*STORAGE_LINES, *TENSOR_LINES)]


def _generated_wrap():
    source = "def wrap(storage, dtype, shape, site):\n"
    source += "".join(f"    {line}\n" for line in TENSOR_LINES) + "    return tensor\n"
    namespace = dict(RESULT_NAMES)
    exec(compile(source, "<flame replay result>", "exec"), namespace)  # noqa: S102
    wrap = namespace["wrap"]
    wrap.__doc__ = """``wrap(storage, dtype, shape, site) -> Tensor``: a result of a replay, a
    tensor over ``storage`` (``TENSOR_LINES``)."""
    return wrap


wrap = _generated_wrap()


def bind_arrays(sources: tuple, args) -> list:
    """The device arrays of a plan's inputs: ``sources`` holds, per input, (True, argument
    position) or (False, Storage) for memory the function closed over."""
    arrays = []
    for is_arg, value in sources:  # every replay's path: storage_of inlined
        if is_arg:
            node = args[value].node
            storage = node.buffer if node.buffer is not None else node.attr("storage")
        else:
            storage = value
        array = storage.array
        arrays.append(array if array is not None else storage.device_array())
    return arrays


# --- the dispatch of one-kernel programs ---------------------------------------------------


_GRAPH_CACHES: weakref.WeakSet = weakref.WeakSet()  # every GraphCache, for release_graphs_of
MISS = object()  # a compiled call the one-kernel path does not take: the general path runs


def direct_key(args) -> tuple:
    """The key of a call whose arguments are all realized tensors, as ``dispatcher``'s
    generated code spells it: the deterministic-algorithms mode, then each argument's
    ``exact_entry`` (backend, dtype, shape, layout) laid out flat, then the autocast dtype
    (flame/amp/autocast_mode.py ``key``)."""
    key = [are_deterministic_algorithms_enabled()]
    for a in args:
        key += exact_entry(a)
    key.append(autocast_key())
    return tuple(key)


def _argument_lines(arity: int) -> list[str]:
    """Body lines that unpack ``args`` into ``a{i}`` and bind each one's node ``n{i}`` and
    storage ``s{i}``, returning ``miss`` unless there are ``arity`` realized tensors."""
    lines = [f"    if len(args) != {arity}:", "        return miss"]
    if arity:
        lines.append(f"    {', '.join(f'a{i}' for i in range(arity))}, = args")
    for i in range(arity):
        lines += [
            f"    if type(a{i}) is not Tensor:",
            "        return miss",
            f"    n{i} = a{i}.node",
            f"    s{i} = n{i}.buffer",
            f"    if s{i} is None:",
            f"        if n{i}.op != 'buffer':",
            "            return miss",
            f"        s{i} = n{i}.attr('storage')",
        ]  # fmt: skip
    return lines


@functools.lru_cache(maxsize=64)
def dispatcher(arity: int):
    """``dispatch(direct, args)``: generated per number of arguments as straight-line
    Python, the value ``direct`` (``direct_key`` -> a program's ``entry``) holds for the
    call's key; None when some argument is not a realized tensor or no program has the key.
    ``flame.compile`` asks it when the last program's entry missed."""
    lines = ["def dispatch(direct, args):", *_argument_lines(arity)]
    key = ["mode()"]
    key += [f"a{i}.backend, n{i}.dtype, n{i}.shape, s{i}.layout()" for i in range(arity)]
    key.append("amp()")
    lines.append(f"    return direct.get(({', '.join(key)},))")
    namespace = {
        "miss": None, "Tensor": Tensor, "mode": are_deterministic_algorithms_enabled,
        "amp": autocast_key,
    }  # fmt: skip
    exec(compile("\n".join(lines) + "\n", "<flame.compile dispatch>", "exec"), namespace)  # noqa: S102
    return namespace["dispatch"]


def _key_test_lines(key: tuple, arity: int) -> tuple[list[str], dict]:
    """Body lines that return ``miss`` unless the arguments bound by ``_argument_lines`` have
    ``key`` (``direct_key``'s layout), and the constants they name: each part compared on
    its own, with no key built or hashed."""
    if len(key) != 2 + 4 * arity or any(len(part) != 2 for part in key[4:-1:4]):
        raise ValueError(f"not a direct_key of {arity} tensors: {key!r:.200}")
    tests, names = ["mode() != k0", "amp() != ka"], {"k0": key[0], "ka": key[-1]}
    for i in range(arity):
        backend, dtype, shape, layout = key[1 + 4 * i : 5 + 4 * i]
        names.update({f"b{i}": backend, f"d{i}": dtype, f"h{i}": shape, f"l{i}": layout})
        tests += [f"a{i}.backend != b{i}", f"n{i}.dtype != d{i}", f"n{i}.shape != h{i}"]
        tests.append(f"(s{i}._layout or s{i}.layout()) != l{i}")
    lines = [f"    if {' or '.join(tests)}:", "        return miss"]
    return lines, names


# --- results: nested tuples, lists and dicts of tensors -------------------------------------


def flatten(result, leaves: list):
    if isinstance(result, Tensor):
        leaves.append(result)
        return "tensor"
    if result is None:
        return None
    if isinstance(result, (tuple, list)):
        return (type(result), tuple(flatten(item, leaves) for item in result))
    if isinstance(result, dict):
        return (dict, tuple(result), tuple(flatten(item, leaves) for item in result.values()))
    raise TypeError(
        f"flame.compile: the function returned a {type(result).__name__}; return tensors, "
        "or tuples, lists or dicts of them"
    )


def unflatten(treedef, leaves):
    if treedef == "tensor":
        return next(leaves)
    if treedef is None:
        return None
    if treedef[0] is dict:
        return {key: unflatten(item, leaves) for key, item in zip(treedef[1], treedef[2])}
    return treedef[0](unflatten(item, leaves) for item in treedef[1])


def capturable(plan, forced: bool, library_ops=None) -> bool:
    """Whether to capture a program into CUDA graphs.

    By default: programs of more than one kernel and no library call. Asked for
    (``cuda_graph=True``): any program whose library calls can run under a capture (cuBLAS
    products and joins, ``CAPTURABLE_LIBRARY_OPS``, or ``library_ops`` when given). Library
    programs are not captured by default because they are large: their launches already
    hide behind the GPU's work (measured: the bf16 MLP step's forward + backward, 7.82 ms
    device time with and without a graph), while a result the caller still holds at the
    next replay -- the gradients a training loop keeps in ``.grad`` -- has to be copied out
    of the graph's memory first (+0.63 ms per MLP step). Training steps of many launches
    are captured by flame/runtime/step_graphs.py instead."""
    from flame.runtime.executor import CAPTURABLE_LIBRARY_OPS
    from flame.runtime.launch import Launch

    if not plan.launches:
        return False
    allowed = CAPTURABLE_LIBRARY_OPS if library_ops is None else library_ops
    for step in plan.launches:
        # a library call, or a collective's join (flame/runtime/plans.py), whose ``node`` is
        # its collective's: captured where the collective is (an event wait, which a
        # capture records as the second stream joining back)
        if not isinstance(step, Launch):
            if not forced or step.node.op not in allowed:
                return False
    return forced or len(plan.launches) > 1


class GraphCache:
    """The CUDA graphs of one program, keyed by the addresses of its inputs (a capture bakes
    them in; an input changed in place keeps its address and is read anew at each replay).

    Every buffer the plan writes is allocated once per graph. The outputs of a replay are
    those buffers, lent to the caller; when a result of the previous replay is still alive at
    the next one, its values are first moved to memory of its own (its tensor keeps them; a
    zero-copy view taken of the old memory, e.g. through DLPack, would see the new values)."""

    LIMIT = 4  # graphs kept per program (each holds its buffers)

    def __init__(self, plan, info):  # info: the CacheInfo counting captures
        self.plan, self.info = plan, info
        self.entries: dict[tuple, list] = {}  # addresses -> [graph, slots, lent, held blocks]
        self.lock = threading.Lock()
        self.failed: str | None = None  # why capturing failed; then never tried again
        self.retried = False  # a capture spoiled from outside was tried again once
        _GRAPH_CACHES.add(self)

    def uses_group(self, group: str) -> bool:
        """Whether the plan holds a collective of the NCCL group named ``group``."""
        return any(
            getattr(step, "node", None) is not None
            and step.node.op in COLLECTIVE_OPS
            and step.node.attr("group") == group
            for step in self.plan.launches
        )

    def release(self, reason: str) -> None:
        """Drop every captured graph (their memory too) and capture no more: ``reason``."""
        with self.lock:
            self.entries.clear()
            self.failed = reason

    def run(self, arrays: list, outputs: tuple, targets=None) -> list | None:
        """The results of one replay; None when capturing failed (the caller then runs the
        plan step by step, as for a program that is never captured). ``targets``: output
        slot -> the array it is written into in place (flame/runtime/step_graphs.py)."""
        import cupy

        if self.failed is not None:
            return None
        key = self._key(arrays, targets)
        with self.lock:
            entry = self.entries.get(key)
            if entry is None:
                if len(self.entries) >= self.LIMIT:
                    self.entries.pop(next(iter(self.entries)))
                try:
                    entry = self._capture(arrays, targets)
                except Exception as error:  # noqa: BLE001  a routine that cannot be captured
                    message = f"{type(error).__name__}: {error}"
                    self.info.graph_failures.append(message)
                    if _spoiled_from_outside(error) and not self.retried:
                        # another thread's CUDA call can spoil a capture: once, try again
                        # at the next call (this one runs step by step)
                        self.retried = True
                        return None
                    self.failed = message
                    return None
                self.entries[key] = entry
            graph, slots, lent = entry[:3]
            self._prepare(entry, arrays)
            for held in lent:  # a result of the last replay the caller still holds
                storage = held() if held is not None else None
                if storage is not None and storage.array is not None:
                    storage.array = storage.array.copy()  # moved out before it is overwritten
            graph.launch(cupy.cuda.get_current_stream())
            self.info.graph_replays += 1
            results = []
            for index, (slot, dtype, shape, site) in enumerate(outputs):
                storage = Storage("cuda", dtype, slots[slot])
                lent[index] = weakref.ref(storage)
                results.append(wrap(storage, dtype, shape, site))
            return results

    def _key(self, arrays: list, targets) -> tuple:
        return tuple([array.data.ptr for array in arrays])

    def _prepare(self, entry: list, arrays: list) -> None:
        """Before a replay's launch (step graphs copy the call's batch in)."""

    def _capture(self, arrays: list, targets=None) -> list:
        """Capture the plan once. Kernels' buffers are allocated before; what library calls
        allocate while capturing comes from the pool on the caller's stream through an
        allocator that keeps every block for the graph (replays write there again)."""
        import cupy

        from flame.runtime.launch import Launch

        plan = self.plan
        slots = list(arrays) + [None] * (plan.slot_count - len(arrays))
        for step in plan.launches:
            if isinstance(step, Launch):
                step.allocate(slots)
        current = cupy.cuda.get_current_stream()
        pool = cupy.get_default_memory_pool()
        held = []  # every block allocated during the capture: owned by the graph

        def allocator(size: int):
            with current:  # the block belongs to the caller's stream, where replays run
                block = pool.malloc(size)
            held.append(block)
            return block

        stream = cupy.cuda.Stream(non_blocking=True)
        stream.wait_event(current.record())  # inputs queued before the capture are ready
        warmup.finish()  # cuBLAS starting on its thread would spoil the capture
        with plans_for_capture(plan.digest), stream, cupy.cuda.using_allocator(allocator):
            stream.begin_capture()
            try:
                for step in plan.launches:
                    if isinstance(step, Launch):
                        step.launch_into(slots)
                    else:
                        step.execute(slots)
            finally:
                graph = stream.end_capture()
        graph.upload(current)
        self.info.graph_captures += 1
        # The graph reads its inputs at the addresses it was captured with, which are this
        # entry's key: it needs their addresses, not the arrays, so the caller's memory is
        # not kept alive by the cache (an address reused by another array of the program's
        # signature is that array's, read anew at each replay).
        for index in range(len(arrays)):
            if index not in plan.output_slots:
                slots[index] = None
        return [graph, slots, [None] * len(plan.output_slots), held]


def fast_replay(plan, sources, out_nodes, flat, treedef, graphs, arity: int, key=None):
    """The replay of a CUDA program that sets no ``.grad``: the per-call work reduced to
    binding arguments, launching, and wrapping the results. ``sources``: per plan input,
    ("arg", position) or ("storage", Storage); ``flat``: per flat result, ("out", index),
    ("arg", position) or ("fixed", tensor); ``graphs``: the program's CUDA graphs, or None;
    ``arity``: the function's number of arguments; ``key``: the traced call's ``direct_key``
    when every argument is a tensor (else None).

    Returns ``(replay, entry)``: ``replay(args)``, and for a program of one kernel and one
    result called with ``key``, ``entry(args)``: the whole call in one generated function,
    which returns ``MISS`` for arguments of another key (``one_kernel_replay``)."""
    from flame.runtime.executor import default_executor

    executor = default_executor()
    sources = tuple((kind == "arg", value) for kind, value in sources)
    outputs = tuple(
        (slot, node.dtype, node.shape, node.site)
        for node, slot in zip(out_nodes, plan.output_slots)
    )  # fmt: skip
    single = treedef == "tensor" and flat[0][0] == "out"
    if graphs is None and single:
        runners = one_kernel_replay(plan, sources, outputs[0], executor, arity, key)
        if runners is not None:
            run, entry = runners
            return (lambda args: run(*map(_storage_or_none, args))), entry

    def replay(args):
        arrays = bind_arrays(sources, args)
        values = graphs.run(arrays, outputs) if graphs is not None else None
        if values is None:
            slots = executor.run(plan, arrays)
            values = [
                wrap(Storage("cuda", dtype, slots[slot]), dtype, shape, site)
                for slot, dtype, shape, site in outputs
            ]  # fmt: skip
        if single:
            return values[0]
        results = [
            values[item] if kind == "out" else args[item] if kind == "arg" else item
            for kind, item in flat
        ]  # fmt: skip
        return unflatten(treedef, iter(results))

    return replay, None


def _storage_or_none(value):
    return storage_of(value.node) if isinstance(value, Tensor) else None


def one_kernel_replay(plan, sources, output, executor, arity: int, key=None):
    """The commonest small program -- one kernel, one result -- as generated runners
    (flame/runtime/direct.py), which bind the inputs' storages (the arguments' and those the
    function closed over), launch the kernel, and make the result's tensor, whose buffer
    they recycle once the caller has dropped the previous one:

    - ``run(s0, ..., s{arity-1})`` takes the arguments' storages (None for an argument that
      is not a tensor);
    - ``entry(args)``, made when ``key`` (the traced call's ``direct_key``) is given, is a
      compiled call's whole fast path in one function: it unpacks the arguments, tests their
      key part by part and runs, or returns ``MISS``.

    ``(run, entry)``; None where the plan does not fit that form."""
    from flame.runtime.direct import one_kernel_runner

    slot, dtype, shape, site = output
    parameters = ", ".join(f"s{i}" for i in range(arity))
    listening = ["    if listening():", f"        return observed({parameters})"]
    storages, closed = [], {}
    for index, (is_arg, value) in enumerate(sources):
        if is_arg:
            storages.append(f"s{value}")
        else:
            closed[f"c{index}"] = value
            storages.append(f"c{index}")

    def observed(*given):  # the dump is listening: the executor runs and reports the plan
        arrays = [
            (given[value] if is_arg else value).device_array() for is_arg, value in sources
        ]  # fmt: skip
        slots = executor.run(plan, arrays)
        return wrap(Storage("cuda", dtype, slots[slot]), dtype, shape, site)

    namespace = {
        **closed, **RESULT_NAMES, "listening": events.active, "observed": observed,
        "dtype": dtype, "shape": shape, "site": site,
        "recycled": [None, None],  # one recycled result buffer for both runners
    }  # fmt: skip
    finish = [*result_lines("out"), "    return tensor"]
    run = one_kernel_runner(
        plan, [f"def run({parameters}):", *listening], storages, finish, namespace
    )
    if run is None:
        return None
    entry = None
    if key is not None:
        tests, constants = _key_test_lines(key, arity)
        header = ["def entry(args):", *_argument_lines(arity), *tests, *listening]
        namespace.update(
            constants, miss=MISS, mode=are_deterministic_algorithms_enabled, amp=autocast_key
        )
        entry = one_kernel_runner(plan, header, storages, finish, namespace)
    return run, entry


def _spoiled_from_outside(error: BaseException | None) -> bool:
    """A capture whose every error says it was invalidated: another thread's CUDA call spoiled
    it (its later launches fail so, and ending it raises so). A step of its own that a
    capture refuses (a synchronization, say) raises its own error first, and ending the
    capture then raises the invalidation with that error as its context."""
    seen = 0
    while error is not None and seen < 8:
        if "StreamCaptureInvalidated" not in str(error):
            return False
        error, seen = error.__cause__ or error.__context__, seen + 1
    return seen > 0


def release_graphs_of(group: str) -> int:
    """Destroy the CUDA graphs that captured a collective of the NCCL group ``group``; the
    programs that own them run step by step from then on. NCCL keeps a communicator alive
    while any graph that captured one of its collectives exists (``ncclCommDestroy`` waits
    for them), so ``destroy_process_group`` calls this first. Returns how many programs'
    graphs were dropped."""
    caches = [cache for cache in list(_GRAPH_CACHES) if cache.entries and cache.uses_group(group)]
    for cache in caches:
        cache.release(f"its NCCL process group {group!r} was destroyed")
    return len(caches)
