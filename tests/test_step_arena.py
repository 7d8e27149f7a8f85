"""A captured training step's buffers placed in one block (flame/runtime/arena.py): the offsets
never let two live buffers overlap, the block is close to the live peak, and a step captured
into it gives the values of one captured from a pool, which it replaces only when the second
capture repeats the recorded one."""

import numpy as np
import pytest

from flame.runtime import arena
from flame.runtime.arena import ALIGNMENT, assign_offsets, live_peak


def _overlaps(sizes, starts, ends, offsets):
    """Pairs of buffers alive at a common moment whose byte ranges overlap."""
    found = []
    rounded = [max(ALIGNMENT, -(-s // ALIGNMENT) * ALIGNMENT) for s in sizes]
    for i in range(len(sizes)):
        for j in range(i + 1, len(sizes)):
            in_time = starts[i] < ends[j] and starts[j] < ends[i]
            in_space = offsets[i] < offsets[j] + rounded[j] and offsets[j] < offsets[i] + rounded[i]
            if in_time and in_space:
                found.append((i, j))
    return found


def _random_lifetimes(seed: int, count: int):
    """A plan-like sequence: allocations in order, each freed a few allocations later (some
    never), sizes spread over four orders of magnitude."""
    rng = np.random.default_rng(seed)
    sizes = (10 ** rng.uniform(2, 7, count)).astype(int).tolist()
    starts, ends, clock = [], [], 0
    for _ in range(count):
        starts.append(clock)
        clock += 1
    for start in starts:
        life = int(rng.integers(1, 12)) if rng.random() > 0.05 else 10**9
        ends.append(min(start + life, clock + 1) if life < 10**9 else clock + 1)
    return sizes, starts, ends


@pytest.mark.parametrize("seed", range(6))
def test_offsets_never_overlap_live_buffers_and_stay_near_the_live_peak(seed):
    sizes, starts, ends = _random_lifetimes(seed, 300)
    offsets, total = assign_offsets(sizes, starts, ends)
    assert not _overlaps(sizes, starts, ends, offsets)
    assert all(offset % ALIGNMENT == 0 for offset in offsets)
    peak = live_peak(sizes, starts, ends)
    assert peak <= total <= 1.25 * peak, (peak, total)
    assert total == max(o + max(ALIGNMENT, -(-s // ALIGNMENT) * ALIGNMENT)
                        for o, s in zip(offsets, sizes))  # fmt: skip


def test_buffers_alive_apart_share_their_memory():
    # a chain: each buffer dies as the next is made -> all at offset 0, the block the largest
    sizes = [4096, 1 << 20, 8192, 3000]
    offsets, total = assign_offsets(sizes, [0, 1, 2, 3], [1, 2, 3, 4])
    assert offsets == [0, 0, 0, 0] and total == 1 << 20
    # all alive at once: packed end to end, rounded to the grid
    offsets, total = assign_offsets([1000, 512, 70], [0, 0, 0], [5, 5, 5])
    assert sorted(offsets) == [0, 1024, 1536] and total == 2048 == live_peak(
        [1000, 512, 70], [0, 0, 0], [5, 5, 5]
    )


def test_a_freed_buffer_is_reused_by_a_later_one_that_fits_beside_a_live_one():
    # A (big) lives throughout; B and C take turns in the space after it
    sizes, starts, ends = [1 << 20, 4096, 4096], [0, 1, 3], [9, 3, 5]
    offsets, total = assign_offsets(sizes, starts, ends)
    assert offsets[1] == offsets[2] and total == (1 << 20) + 4096


def test_the_live_peak_counts_a_free_before_an_allocation_at_the_same_moment():
    assert live_peak([1024, 1024], [0, 1], [1, 2]) == 1024
    assert live_peak([1024, 1024], [0, 1], [2, 2]) == 2048


def test_a_placement_round_trips_through_bytes_and_refuses_others():
    planned = arena.ArenaPlan((4096, 100, 7000), (0, 4096, 0), 11264, 11264, (1, 0), (0, 0, 1))
    back = arena.ArenaPlan.from_bytes(planned.to_bytes())
    for name in arena.ArenaPlan.__slots__:
        assert getattr(back, name) == getattr(planned, name), name
    with pytest.raises(ValueError):
        arena.ArenaPlan.from_bytes(planned.to_bytes()[:-8])  # truncated
    with pytest.raises(ValueError):
        arena.ArenaPlan.from_bytes(np.asarray([99, 0, 0, 0, 0], "<i8").tobytes())  # format


def test_a_placement_is_kept_on_disk_under_the_plan_key(tmp_path, monkeypatch):
    from flame.runtime import step_graphs
    from flame.runtime.cache import DiskCache

    disk = DiskCache(tmp_path)
    monkeypatch.setattr(step_graphs, "_arena_disk", lambda digest: disk if digest else None)
    planned = arena.ArenaPlan((512,), (0,), 512, 512, (0,), (0,))
    assert step_graphs._stored_arena("abc") is None
    step_graphs._store_arena("abc", planned)
    assert step_graphs._stored_arena("abc").sizes == (512,)
    assert step_graphs._stored_arena("other") is None
    step_graphs._store_arena("", planned)  # a plan not in the store: nothing kept
    disk.put(step_graphs._arena_key("abc"), b"garbage")
    assert step_graphs._stored_arena("abc") is None


# ---------------------------------------------------------------- on the GPU


def _trainer(seed: int = 0):
    import flame as fl
    import flame.nn as nn
    import flame.nn.functional as F

    fl.manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.GroupNorm(8, 32), nn.SiLU(),
        nn.Conv2d(32, 32, 3, padding=1), nn.GroupNorm(8, 32), nn.SiLU(),
        nn.Conv2d(32, 8, 3, padding=1), nn.Flatten(), nn.Linear(8 * 64, 10),
    )  # fmt: skip
    optimizer = fl.optim.AdamW(model.parameters(), lr=1e-2)

    @fl.compile(cuda_graph=True)
    def step(images, labels):
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        return loss

    return model, step


def _train(monkeypatch, arena_on: bool, steps: int = 4):
    import flame as fl

    monkeypatch.setenv("FLAME_STEP_ARENA", "1" if arena_on else "0")
    model, step = _trainer()
    batches = np.random.default_rng(1)
    losses = []
    for _ in range(steps):
        images = fl.tensor(batches.standard_normal((16, 3, 8, 8)).astype(np.float32))
        labels = fl.tensor(batches.integers(0, 10, 16))
        model.zero_grad(set_to_none=True)
        losses.append(float(step(images, labels).item()))
    return losses, [p.numpy() for p in model.parameters()], step.cache_info()


@pytest.mark.gpu
def test_a_step_captured_into_the_arena_matches_one_captured_from_a_pool(monkeypatch):
    pooled = _train(monkeypatch, False)
    placed = _train(monkeypatch, True)
    # (cuDNN's weight gradients need not sum in the same order from run to run)
    np.testing.assert_allclose(placed[0], pooled[0], rtol=1e-5, atol=1e-6)
    for got, want in zip(placed[1], pooled[1]):
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-5)
    (memory,) = placed[2].graph_memory
    (pooled_memory,) = pooled[2].graph_memory
    assert memory["arena"] and not pooled_memory["arena"], (memory, pooled_memory)
    assert memory["live_peak"] <= memory["block"] <= memory["bytes"]
    assert memory["bytes"] <= pooled_memory["bytes"], (memory, pooled_memory)
    assert placed[2].graph_captures == 1 and not placed[2].graph_failures
    # the same step again (the executor's plan, another model of the same shapes): the
    # placement kept on the plan is used, not recorded again
    again = _train(monkeypatch, True)
    (memory_again,) = again[2].graph_memory
    assert memory_again["arena"] and memory_again["placement"] == "memory", memory_again
    assert memory_again["block"] == memory["block"]
    np.testing.assert_allclose(again[0], placed[0], rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_a_stale_placement_is_recorded_again(monkeypatch):
    placed = _train(monkeypatch, True)
    (memory,) = placed[2].graph_memory
    assert memory["placement"] in ("recorded", "memory", "disk")
    from flame.runtime import executor

    for plan in list(executor.default_executor()._plans.values()):  # every plan's placement off
        if plan.arena is not None:
            wrong = plan.arena
            stale = arena.ArenaPlan((1 << 20,) + wrong.sizes[1:], wrong.offsets, wrong.total,
                                    wrong.peak, wrong.free_order, wrong.frees_before)  # fmt: skip
            object.__setattr__(plan, "arena", stale)
    again = _train(monkeypatch, True)
    (memory_again,) = again[2].graph_memory
    assert memory_again["arena"] and memory_again["placement"] == "recorded", memory_again
    np.testing.assert_allclose(again[0], placed[0], rtol=1e-5, atol=1e-6)


def _forget_placements(monkeypatch):
    """No placement kept on the executor's plans or found on disk: the next capture records."""
    from flame.runtime import executor, step_graphs

    monkeypatch.setattr(step_graphs, "_stored_arena", lambda digest: None)
    for plan in list(executor.default_executor()._plans.values()):
        object.__setattr__(plan, "arena", None)


@pytest.mark.gpu
def test_a_second_capture_that_differs_from_the_recording_falls_back_to_the_pool(monkeypatch):
    recorded_plan = arena.Recorder.plan

    def altered(recorder):  # as if the second capture asked for another size
        made = recorded_plan(recorder)
        made.sizes = (made.sizes[0] + 512,) + made.sizes[1:]
        return made

    monkeypatch.setattr(arena.Recorder, "plan", altered)
    _forget_placements(monkeypatch)  # so that this capture records
    placed = _train(monkeypatch, True)
    monkeypatch.setattr(arena.Recorder, "plan", recorded_plan)
    pooled = _train(monkeypatch, False)
    np.testing.assert_allclose(placed[0], pooled[0], rtol=1e-5, atol=1e-6)
    (memory,) = placed[2].graph_memory
    assert not memory["arena"] and "allocation 0" in memory["reason"], memory


@pytest.mark.gpu
def test_the_arena_allocator_notes_a_buffer_freed_later_than_recorded():
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    pool = cupy.cuda.MemoryPool()
    recorder = arena.Recorder(pool, stream.ptr, capacity=1 << 20)
    with stream:
        first = recorder(4096)
        del first  # freed before the second allocation
        second = recorder(4096)
    del second
    planned = recorder.plan()
    assert planned.offsets == (0, 0) and planned.total == 4096
    allocator = arena.ArenaAllocator(planned, pool.malloc(planned.total), pool.malloc)
    held = allocator(4096)  # not freed this time: the second may not share its memory
    other = allocator(4096)
    assert other.ptr != held.ptr  # served from the fallback pool
    with pytest.raises(arena.ArenaDeclined, match="freed before it"):
        allocator.check()


def test_the_recording_block_fits_first_and_merges_freed_ranges():
    fit = arena._FirstFit(4096)
    a, b, c = fit.take(1024), fit.take(1024), fit.take(1024)
    assert (a, b, c) == (0, 1024, 2048) and fit.take(2048) is None
    fit.give(b, 1024)
    assert fit.take(1536) is None  # 1024 free in the middle, 1024 at the end: apart
    fit.give(a, 1024)  # merged with b's range: 2048 from 0
    assert fit.free == [(0, 2048), (3072, 1024)]
    fit.give(c, 1024)  # everything merged again
    assert fit.free == [(0, 4096)] and fit.take(4096) == 0


@pytest.mark.gpu
def test_a_recording_past_its_block_takes_buffers_from_the_pool():
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    pool = cupy.cuda.MemoryPool()
    recorder = arena.Recorder(pool, stream.ptr, capacity=8192)
    with stream:
        inside = recorder(4096)
        beyond = recorder(16384)  # larger than the block: its own memory
        also = recorder(4096)
    block = recorder.block.ptr
    assert inside.ptr == block and also.ptr == block + 4096
    assert not block <= beyond.ptr < block + 8192
    del inside, beyond, also
    planned = recorder.plan()
    assert planned.sizes == (4096, 16384, 4096) and planned.total == 24576
