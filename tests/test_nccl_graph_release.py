"""Destroying or aborting an NCCL group first drops the CUDA graphs that captured its
collectives: NCCL's ``ncclCommDestroy``/``ncclCommAbort`` wait until no such graph exists, so
with two ranks a process that still held a captured training step hung at
``destroy_process_group`` (seen on two H200s). CPU tier: graph caches over stand-in plans and
a stand-in communicator record what happens in which order."""

from __future__ import annotations

import types

import pytest

from flame import replay
from flame.ir.dtypes import float32
from flame.ir.node import Node
from flame.runtime import library_nccl


class _Info:
    graph_failures: list = []


def _cache(*steps) -> replay.GraphCache:
    plan = types.SimpleNamespace(launches=list(steps))
    cache = replay.GraphCache(plan, _Info())
    cache.entries[("address",)] = ["graph", [], []]
    return cache


def _collective(op: str, group: str):
    node = Node(op, (), (("group", group), ("op", "sum"), ("world", 2)), float32, (4,))
    return types.SimpleNamespace(node=node)


def _kernel():
    return types.SimpleNamespace(spec=types.SimpleNamespace(name="flame_ew_add"))


def test_only_the_graphs_of_the_group_are_released():
    of_a = _cache(_kernel(), _collective("all_reduce", "group-a"), _kernel())
    of_b = _cache(_collective("broadcast", "group-b"))
    no_collective = _cache(_kernel())
    assert replay.release_graphs_of("group-a") == 1
    assert of_a.entries == {} and "group-a" in of_a.failed
    assert of_b.entries and of_b.failed is None
    assert no_collective.entries and no_collective.failed is None
    # a released program runs step by step from then on: no new capture
    assert of_a.run([], ()) is None


@pytest.mark.parametrize("op", ["all_reduce", "broadcast", "all_gather", "reduce_scatter"])
def test_every_collective_ties_a_graph_to_its_group(op):
    cache = _cache(_collective(op, "group-c"))
    assert cache.uses_group("group-c") and not cache.uses_group("group-d")


class _Communicator:
    def __init__(self, cache, seen):
        self.cache, self.seen = cache, seen

    def destroy(self):
        self.seen.append(("destroy", bool(self.cache.entries)))

    def abort(self):
        self.seen.append(("abort", bool(self.cache.entries)))


@pytest.mark.parametrize("end", ["destroy", "abort"])
def test_destroy_and_abort_release_the_graphs_before_nccl_waits_for_them(end, monkeypatch):
    cupy = pytest.importorskip("cupy")
    monkeypatch.setattr(
        cupy.cuda, "get_current_stream",
        lambda: types.SimpleNamespace(synchronize=lambda: None, ptr=0),
    )  # fmt: skip
    cache, seen = _cache(_collective("all_reduce", "group-e")), []
    monkeypatch.setitem(library_nccl._COMMUNICATORS, "group-e", _Communicator(cache, seen))
    getattr(library_nccl, end)("group-e")
    assert seen == [(end, False)]  # the graph was gone when NCCL was asked
    assert "group-e" not in library_nccl._COMMUNICATORS
