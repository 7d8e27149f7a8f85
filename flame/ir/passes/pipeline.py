"""The pass pipeline, in order. Each step is a pure ``Graph -> Graph`` function."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from flame.ir.graph import Graph
from flame.ir.passes import reuse
from flame.ir.passes.cse import cse
from flame.ir.passes.dce import dce
from flame.ir.passes.fuse import fuse
from flame.ir.passes.joins import join_padded_sums
from flame.ir.passes.late_reads import late_reads
from flame.ir.passes.layouts import layouts
from flame.ir.passes.lift import lift_row_epilogues
from flame.ir.passes.remat import remat
from flame.ir.passes.reuse import Decisions
from flame.ir.passes.simplify import simplify
from flame.ir.passes.split import split_reductions
from flame.ir.verify import verify

PIPELINE = (
    split_reductions,  # big reductions with few outputs run in two stages
    lift_row_epilogues,  # elementwise ops after a row kernel's reshape join the row kernel
    join_padded_sums,  # sums of zero-padded pieces (a split's backward) -> one cat
    simplify,  # fold constants, drop identities (x*1, expand to the same shape, ...)
    layouts,  # values downstream of channels-last convs stay channels-last
    cse,  # one node per distinct computation
    dce,  # only what the outputs need
    late_reads,  # a library operand read again much later is computed again there, not kept
    fuse,  # elementwise groups -> kernels
    remat,  # values several kernels need: saved once or recomputed (a min-cut)
)


@dataclass(frozen=True)
class PassRecord:
    name: str
    seconds: float
    graph: Graph


def run_pipeline(
    graph: Graph,
    record: bool = False,
    verify_each: bool | None = None,
    decisions: Decisions | None = None,
):
    """Run every pass; with ``record`` return ``(graph, [PassRecord, ...])`` for the dump.

    ``verify_each`` (default: the ``FLAME_VERIFY`` environment variable) re-checks every node
    against its op's rule after every pass. ``decisions`` (reuse.py) answer the fusions of a
    graph structure fused before at other sizes, and keep this run's (``FLAME_PLAN_REUSE=0``:
    neither).
    """
    if verify_each is None:
        verify_each = os.environ.get("FLAME_VERIFY", "") not in ("", "0")
    history = [PassRecord("input", 0.0, graph)] if record else None
    with reuse.using(decisions):
        for step in PIPELINE:
            start = time.perf_counter()
            graph = _nodes_kept(graph, step(graph))
            elapsed = time.perf_counter() - start
            if verify_each:
                verify(graph, after=step.__name__)
            if record:
                history.append(PassRecord(step.__name__, elapsed, graph))
    return (graph, history) if record else graph


def _nodes_kept(before: Graph, after: Graph) -> Graph:
    """``after`` given ``before``'s node order where a pass kept every output (dce with
    nothing dead, fusion and the save-or-recompute pass adding groups): the same outputs
    reach the same nodes, and the UNet's ~20,000-node order costs ~30 ms a sort."""
    known = before._nodes
    if (
        after is not before and after._nodes is None and known is not None
        and len(after.outputs) == len(before.outputs)
        and all(a is b for a, b in zip(after.outputs, before.outputs))
    ):  # fmt: skip
        object.__setattr__(after, "_nodes", list(known))
    return after
