"""What ``flame.compile`` keeps: a compiled function's cache counters (``CacheInfo``) and
its prepared programs (``_Program``: the plan, where each input comes from, how the results
are rebuilt, and the program's effects)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CacheInfo:
    traces: int = 0  # every trace: new signatures and new sizes
    hits: int = 0  # calls that replayed a prepared program
    misses: int = 0  # calls with a new signature
    replans: int = 0  # calls with a known signature and new sizes (kernels reused)
    reasons: list = field(default_factory=list)  # why each miss or re-plan happened
    graph_captures: int = 0  # CUDA graphs captured (one per program and input addresses)
    graph_replays: int = 0  # calls replayed as one CUDA-graph launch
    graph_failures: list = field(default_factory=list)  # captures that failed, and why
    # per captured step graph: {"arena", "bytes" (its pool), "reason", "capture_s"; in an
    # arena also "placement" (recorded, memory, disk), "live_peak", "block" (bytes),
    # "allocations", "prepare_s" (loading or recording and placing), "record_s"}
    graph_memory: list = field(default_factory=list)
    # kernels a trace loaded from disk or compiled: {"trace", "kernel", "origin", "reason",
    # "size_class"}; a compile after the first trace names what changed (never a size alone)
    kernels: list = field(default_factory=list)


@dataclass(frozen=True)
class OutputSpec:
    """What replaying needs of a traced output to wrap its buffer as a tensor."""

    dtype: object
    shape: tuple
    site: object


@dataclass
class _Program:
    # computed outputs, in plan order: on CUDA their ``OutputSpec`` (type and user line; the
    # traced nodes would keep the first call's arguments alive), on the reference backend the
    # traced nodes, which it evaluates
    out_nodes: tuple
    sources: tuple  # per plan input: ("arg", position) | ("storage", Storage) | ("grad", index)
    plan: object  # executor Plan (CUDA) or None (reference)
    treedef: object  # how to rebuild fn's result from its flat outputs
    flat: tuple  # per flat result: ("out", index into out_nodes) | ("arg", position)
    grads: tuple  # (weakref to owner, had a grad at trace time, flat index of the new grad)
    reference_inputs: tuple = ()  # reference backend: (node, source) pairs
    fast: object = None  # the replay of a plain CUDA program: args -> result
    entry: object = None  # one kernel, one result, tensor arguments: the generated call
    key: tuple | None = None  # the traced call's direct_key (every argument a tensor)
    # (generator, numbers drawn per call): advanced, and its state buffer written, per call
    generators: tuple = ()
    backend: str = "cuda"
    # in-place writes: (("arg", position) | ("storage", Storage), flat index of the value)
    writes: tuple = ()
    # per write the plan computes straight into the memory: its output slot (else None)
    direct: tuple = ()
    # a program that sets gradients or writes in place: its CUDA graphs (runtime/step_graphs.py)
    graphs: object = None

    def guards_hold(self) -> bool:
        for owner_ref, had_grad, _ in self.grads:
            owner = owner_ref()
            if owner is None or (had_grad is not None and (owner.grad is not None) != had_grad):
                return False
        return True
