"""CUDA graphs of whole training steps (flame/runtime/step_graphs.py): a compiled step that sets
``.grad``, draws random numbers and updates parameters and optimizer state in place, replayed
as one graph launch, gives the values of the same step run kernel by kernel."""

import numpy as np
import pytest

import flame as fl
import flame.nn as nn
import flame.nn.functional as F
from flame.runtime import step_graphs


def _model(seed: int):
    fl.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.SiLU(),
        nn.Conv2d(16, 16, 3, padding=1), nn.Flatten(), nn.Dropout(0.1), nn.Linear(16 * 64, 10),
    )  # fmt: skip


def _trainer(cuda_graph):
    model = _model(0)
    optimizer = fl.optim.AdamW(model.parameters(), lr=1e-2)
    ema = [p.detach().clone() for p in model.parameters()]
    generator = fl.Generator().manual_seed(5)

    @fl.compile(cuda_graph=cuda_graph)
    def step(images, labels):
        noise = fl.randn(images.shape, generator=generator)
        loss = F.cross_entropy(model(images + 0.1 * noise), labels)
        loss.backward()
        optimizer.step()
        with fl.no_grad():
            for average, p in zip(ema, model.parameters()):
                average.lerp_(p, 0.1)
        return loss

    return model, ema, step


@pytest.mark.gpu
def test_a_captured_training_step_matches_the_step_run_kernel_by_kernel(rng):
    runs = {}
    for cuda_graph in (False, True):
        model, ema, step = _trainer(cuda_graph)
        losses = []
        batches = np.random.default_rng(0)
        for _ in range(5):  # a new batch (a new array) every step
            images = fl.tensor(batches.standard_normal((4, 3, 8, 8)).astype(np.float32))
            labels = fl.tensor(batches.integers(0, 10, 4))
            model.zero_grad(set_to_none=True)  # a .grad the trace reads would retrace
            losses.append(float(step(images, labels).item()))
        grads = [p.grad.numpy() for p in model.parameters()]
        runs[cuda_graph] = (losses, [p.numpy() for p in model.parameters()], grads,
                            [e.numpy() for e in ema], step.cache_info())  # fmt: skip
    plain, graphed = runs[False], runs[True]
    np.testing.assert_allclose(graphed[0], plain[0], rtol=1e-5, atol=1e-6)
    for index in (1, 2, 3):
        for got, want in zip(graphed[index], plain[index]):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    info = graphed[4]
    assert not info.graph_failures, info.graph_failures
    assert info.graph_captures == 1 and info.graph_replays == 5  # the first call too
    assert plain[4].graph_replays == 0
    assert len(set(graphed[0])) == 5  # new noise and dropout every step


@pytest.mark.gpu
def test_a_gradient_held_across_a_replay_keeps_its_values(rng):
    model, _, step = _trainer(True)
    images = fl.tensor(rng.standard_normal((4, 3, 8, 8)).astype(np.float32))
    labels = fl.tensor(rng.integers(0, 10, 4))
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        step(images, labels)
    held = model[0].weight.grad  # the graph's memory, lent
    before = held.numpy().copy()
    model.zero_grad(set_to_none=True)
    step(images, labels)
    np.testing.assert_array_equal(held.numpy(), before)
    assert not np.array_equal(model[0].weight.grad.numpy(), before)


class _Plan:
    def __init__(self, launches):
        self.launches = launches


class _Call:  # a library step
    def __init__(self, op):
        self.node = type("N", (), {"op": op})()


def test_capture_policy():
    from flame.runtime.launch import Launch

    many = [object.__new__(Launch) for _ in range(step_graphs.STEP_GRAPH_LAUNCHES)]
    assert step_graphs.wanted(_Plan(many), None)
    assert not step_graphs.wanted(_Plan(many[:3]), None)  # small: launches hide behind work
    assert step_graphs.wanted(_Plan(many[:3]), True)
    assert not step_graphs.wanted(_Plan(many), False)
    assert not step_graphs.wanted(_Plan([]), True)
    assert step_graphs.wanted(_Plan(many + [_Call("conv"), _Call("scatter_add")]), None)
    assert not step_graphs.wanted(_Plan(many + [_Call("scatter_extreme")]), True)  # syncs


class _Array:
    def __init__(self, nbytes):
        self.nbytes = nbytes


class _Program:
    def __init__(self, sources, writes):
        self.sources, self.writes = sources, writes


def test_small_arguments_are_copied_into_the_graph_large_or_written_ones_key_it():
    program = _Program(
        sources=(("arg", 0), ("arg", 1), ("arg", 2), ("storage", None), ("grad", 0)),
        writes=((("arg", 1), 0),),
    )
    arrays = [_Array(1 << 20), _Array(1 << 20), _Array(step_graphs.STATIC_ARGUMENT_BYTES + 1),
              _Array(16), _Array(16)]  # fmt: skip
    assert step_graphs.static_positions(program, arrays) == {0}


def test_graph_pool_bytes_counts_only_live_graphs():
    class _Pool:
        def total_bytes(self):
            return 1000

    graphs = step_graphs.StepGraphs(plan=None, info=None, static_positions=frozenset())
    before = step_graphs.graph_pool_bytes()
    graphs.entries[("key",)] = [None, None, None, None, _Pool()]
    assert step_graphs.graph_pool_bytes() == before + 1000
    del graphs
    import gc

    gc.collect()
    assert step_graphs.graph_pool_bytes() == before
