"""The fusion pass's groupings on disk (flame/runtime/fusion_store.py): a new process that
loaded its first step's plan from disk never fused, yet reuses the grouping an earlier
process made when its step meets a new size. Planned on the CUDA backend without a GPU, as
tests/test_plan_reuse_sizes.py does; an executor over the same cache directory stands for
the new process."""

from __future__ import annotations

from flame.ir.passes import fuse as fuse_module
from flame.runtime import executor as executor_module
from flame.runtime import fusion_store
from tests.test_plan_reuse_sizes import (  # noqa: F401  (planning: a fixture)
    SHAPES,
    PlanningExecutor,
    _diffusion_step,
    _images,
    call,
    check_plans,
    planning,
)


def _new_process(planning, monkeypatch):  # noqa: F811
    """An executor with nothing in memory over the first one's cache directory."""
    fresh = PlanningExecutor(planning.kernels)
    fresh.loaded, fresh.made = [], []
    monkeypatch.setattr(executor_module, "_executor", fresh)
    return fresh


def _count_fusions(monkeypatch) -> list:
    fusions = []
    anew = fuse_module.fuse_anew
    monkeypatch.setattr(fuse_module, "fuse_anew", lambda *a: fusions.append(1) or anew(*a))
    return fusions


def test_a_new_process_reuses_a_grouping_from_disk(planning, monkeypatch):  # noqa: F811
    monkeypatch.setenv("FLAME_PLAN_CACHE", "1")
    check_plans(call(planning, _diffusion_step(), _images(SHAPES[0])))
    assert planning.decisions.fused > 0 and planning.decisions.read == 0
    fresh = _new_process(planning, monkeypatch)
    fusions = _count_fusions(monkeypatch)
    plans = call(fresh, _diffusion_step(), _images(SHAPES[2]))
    check_plans(plans)
    assert fresh.decisions.read > 0, "no grouping read from disk"
    assert fresh.decisions.reused > 0 and not fusions, "the fusion pass ran in full"


def test_no_store_without_the_plan_cache(planning, monkeypatch):  # noqa: F811
    call(planning, _diffusion_step(), _images(SHAPES[0]))  # FLAME_PLAN_CACHE=0 (fixture)
    fresh = _new_process(planning, monkeypatch)
    check_plans(call(fresh, _diffusion_step(), _images(SHAPES[2])))
    assert fresh.decisions.read == 0 and fresh.decisions.fused > 0


def test_unreadable_or_foreign_entries_are_misses(planning, monkeypatch):  # noqa: F811
    """Every stored grouping overwritten with JSON of another shape, then with positions
    past or before the graph's nodes, then with an input index a node does not have: the
    new process fuses in full and plans valid groups. Another FLAME (source digest) never
    finds them."""
    monkeypatch.setenv("FLAME_PLAN_CACHE", "1")
    written = {}
    put = fusion_store.FusionStore.put
    monkeypatch.setattr(fusion_store.FusionStore, "put",
                        lambda self, key, entries: written.setdefault(key, (self, entries))
                        and put(self, key, entries))  # fmt: skip
    call(planning, _diffusion_step(), _images(SHAPES[0]))
    assert written, "nothing stored"

    def past_the_nodes(entries):
        first = entries[0]
        groups = [[kind, [10**6], outputs, why] for kind, _, outputs, why in first["groups"]]
        return [{**first, "groups": groups}]

    def before_the_nodes(entries):
        first = entries[0]
        groups = [[kind, [-3], outputs, why] for kind, _, outputs, why in first["groups"]]
        return [{**first, "groups": groups}]

    def past_the_inputs(entries):  # a member named by (reader, input index) it does not have
        first = entries[0]
        groups = [[kind, [[0, 99]], outputs, why] for kind, _, outputs, why in first["groups"]]
        return [{**first, "groups": groups}]

    spoils = (lambda entries: [{"groups": "none"}], past_the_nodes, before_the_nodes)
    shapes = (SHAPES[1], SHAPES[2], (4, 8, 8, 8), (2, 8, 10, 10))  # no stored plan either
    for spoil, shape in zip(spoils, shapes):
        for key, (store, entries) in written.items():
            put(store, key, spoil(entries))
        fresh = _new_process(planning, monkeypatch)
        check_plans(call(fresh, _diffusion_step(), _images(shape)))
        assert fresh.decisions.read == 0 and fresh.decisions.fused > 0
    for key, (store, entries) in written.items():
        put(store, key, past_the_inputs(entries))
    fresh = _new_process(planning, monkeypatch)
    check_plans(call(fresh, _diffusion_step(), _images(shapes[3])))
    assert fresh.decisions.read > 0 and fresh.decisions.reused == 0  # read, not applied
    for key, (store, entries) in written.items():
        put(store, key, entries)
    fresh = _new_process(planning, monkeypatch)
    fresh.decisions.store = fusion_store.FusionStore(fresh.kernels.disk, "another flame")
    call(fresh, _diffusion_step(), _images(SHAPES[3]))
    assert fresh.decisions.read == 0 and fresh.decisions.fused > 0


def test_stored_groupings_round_trip(planning, monkeypatch):  # noqa: F811
    from flame.ir.passes.reuse import _Recorded

    monkeypatch.setenv("FLAME_PLAN_CACHE", "1")
    call(planning, _diffusion_step(), _images(SHAPES[0]))
    recorded = [entry for entries in planning.decisions._entries.values() for entry in entries]
    assert recorded
    for entry in recorded:
        back = _Recorded.from_data(entry.data())
        assert (back.groups, back.signatures, back.handed_out) == (
            entry.groups, entry.signatures, entry.handed_out)  # fmt: skip


def test_groupings_read_from_disk_stay_within_the_limit(planning, monkeypatch):  # noqa: F811
    """Groupings read back count against ``max_graphs`` as recorded ones do."""
    monkeypatch.setenv("FLAME_PLAN_CACHE", "1")
    for shape in (SHAPES[0], (1, 8, 8, 8)):  # a batch of 1 is another structure
        call(planning, _diffusion_step(), _images(shape))
    fresh = _new_process(planning, monkeypatch)
    fresh.decisions.max_graphs = 1
    for shape in (SHAPES[1], (1, 8, 12, 12)):
        check_plans(call(fresh, _diffusion_step(), _images(shape)))
    assert fresh.decisions.read >= 2
    assert len(fresh.decisions._entries) <= 1
