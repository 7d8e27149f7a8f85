"""``flame.checkpoint`` saves memory in a planned training step (CPU tier: plans are built for
the CUDA backend without a GPU), and recomputes under the forward's autocast state.

Two faults made checkpointing cost memory instead of saving it (the diffusion UNet's planned
peak went from 1.23 GB to 2.39 GB with ``--checkpoint-blocks``): the backward rebuilt each
region outside the autocast region (float32 recomputations of bf16 values), and nothing kept
the rebuilt values from being scheduled right after the forward, so they lived through the
whole backward beside the values they were meant to replace.
"""

from __future__ import annotations

import numpy as np
import pytest
from plan_memory import planned_peak

import flame as fl
from flame.ir.graph import Graph
from flame.ir.node import toposort
from flame.ir.passes import run_pipeline

F = fl.nn.functional
BLOCKS = 6
PLANNED = (4096, 256, 1024)  # rows, width, hidden: the planned-peak test (nothing runs)
COMPUTED = (16, 8, 32)  # the same model small enough for the reference backend


def _step(rng, checkpoint: bool, backend_dtype=fl.bfloat16, sizes=PLANNED):
    """(loss, gradients of every weight) of a residual MLP stack under autocast, lazily."""
    rows, width, hidden = sizes
    scale = 1.0 / np.sqrt(width)
    weights = [
        (
            fl.tensor((rng.standard_normal((hidden, width)) * scale).astype(np.float32)),
            fl.tensor((rng.standard_normal((width, hidden)) * scale).astype(np.float32)),
        )
        for _ in range(BLOCKS)
    ]
    x = fl.tensor(rng.standard_normal((rows, width)).astype(np.float32))
    target = fl.tensor(rng.standard_normal((rows, width)).astype(np.float32))
    flat = [w for pair in weights for w in pair]

    def loss_of(*flat):
        h = x
        with fl.autocast("cuda", dtype=backend_dtype):
            for index in range(BLOCKS):
                up, down = flat[2 * index], flat[2 * index + 1]

                def block(h, up=up, down=down):
                    return h + F.linear(F.gelu(F.linear(h, up)), down)

                h = fl.checkpoint(block, h) if checkpoint else block(h)
            return F.mse_loss(h.float(), target)

    loss, pullback = fl.vjp(loss_of, *flat)
    return loss, pullback(fl.ones_like(loss))


def _peak(outputs) -> tuple[int, Graph]:
    graph = run_pipeline(Graph(tuple(t.node for t in outputs)))
    return planned_peak(graph), graph


def test_checkpointed_blocks_lower_the_planned_peak(cuda_backend, rng, monkeypatch):
    from flame.runtime import launch
    from flame.runtime.device import DeviceInfo

    fake = DeviceInfo("CPU stand-in for an H100", "sm_90", 132, 50 * 2**20)
    monkeypatch.setattr(launch, "device_info", lambda: fake)  # grids are planned for an H100
    seed = int(rng.integers(1 << 30))
    loss, grads = _step(np.random.default_rng(seed), checkpoint=False)
    plain, _ = _peak([loss, *grads])
    loss, grads = _step(np.random.default_rng(seed), checkpoint=True)
    saved, graph = _peak([loss, *grads])
    # plain keeps 6 blocks' [4096, 1024] hidden values (and their GELU inputs) for the
    # backward; checkpointed, one block's at a time
    assert saved < 0.6 * plain, (saved, plain)
    # the recomputation ran under autocast: no float32 matmul of the blocks
    matmuls = [n for n in toposort(list(graph.outputs)) if n.op == "matmul"]
    assert matmuls and all(n.dtype is fl.bfloat16 for n in matmuls), {n.dtype.name for n in matmuls}


@pytest.mark.parametrize("dtype", [fl.bfloat16, fl.float16], ids=["bf16", "f16"])
def test_checkpoint_under_autocast_gives_the_same_gradients(dtype, reference_backend, rng):
    """Recomputed in the forward's dtype, the backward is the plain one, bit for bit."""
    seed = int(rng.integers(1 << 30))
    loss, grads = _step(np.random.default_rng(seed), False, dtype, COMPUTED)
    loss_c, grads_c = _step(np.random.default_rng(seed), True, dtype, COMPUTED)
    np.testing.assert_array_equal(loss.numpy(), loss_c.numpy())
    for plain, saved in zip(grads, grads_c, strict=True):
        np.testing.assert_array_equal(plain.numpy(), saved.numpy())
