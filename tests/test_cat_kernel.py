"""``cat`` on the GPU: one FLAME kernel for the whole join when every piece is C-contiguous
(flame/runtime/library_joining.py, ``indexing_kernels.cat_source``), and a join of pieces
that are all the same permute of their values done in the values' own order (simplify's
``_cat_of_permutes``: a UNet's skip join of two channels-last conv results)."""

from __future__ import annotations

import numpy as np
import pytest

import flame as fl
from flame.ir.graph import Graph
from flame.ir.node import toposort
from flame.ir.passes import run_pipeline
from flame.runtime import indexing_kernels


def _array(rng, shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def test_cat_kernels_compile(nvrtc):
    from flame.runtime.compiler import nvrtc_compile

    for count, vector, offset in ((2, 16, "int"), (6, 2, "int"), (3, 1, "long long")):
        name = f"cat_{count}_{vector}"
        source = indexing_kernels.cat_source(name, count, vector, offset)
        assert source.count("const offset_t") >= 2 and f"in{count - 1}" in source
        nvrtc_compile(source, name, "sm_90")
    for rank, vector, offset in ((1, 16, "int"), (3, 2, "int"), (4, 1, "long long")):
        name = f"copy_{rank}_{vector}"
        nvrtc_compile(indexing_kernels.copy_source(name, rank, vector, offset), name, "sm_90")


def test_a_join_of_permuted_pieces_joins_their_values(cuda_backend, rng):
    """cat(permute(a), permute(b), dim=1) is planned as permute(cat(a, b, dim=3)): the join
    reads both values in their own (channels-last) order."""
    a, b = (fl.tensor(_array(rng, (2, 5, 6, c))).exp() for c in (8, 4))
    joined = fl.cat([a.permute(0, 3, 1, 2), b.permute(0, 3, 1, 2)], 1) * 2.0
    graph = run_pipeline(Graph((joined.node,)))
    (cat,) = [node for node in toposort(list(graph.outputs)) if node.op == "cat"]
    assert cat.attr("dim") == 3 and tuple(cat.shape) == (2, 5, 6, 12)
    assert all(piece.op != "permute" for piece in cat.inputs)


def test_pieces_in_different_orders_are_left_alone(cuda_backend, rng):
    a = fl.tensor(_array(rng, (2, 5, 6, 8))).exp().permute(0, 3, 1, 2)
    b = fl.tensor(_array(rng, (2, 4, 5, 6))).exp()
    graph = run_pipeline(Graph(((fl.cat([a, b], 1) * 2.0).node,)))
    (cat,) = [node for node in toposort(list(graph.outputs)) if node.op == "cat"]
    assert cat.attr("dim") == 1


@pytest.mark.parametrize(
    "shapes, dim",
    [
        ([(2, 5, 6, 8), (2, 5, 6, 4)], 3),  # channels: 16-byte vectors for float32
        ([(3, 7), (3, 1), (3, 2)], 1),  # 4-byte pieces
        ([(4, 3, 5), (1, 3, 5)], 0),  # leading axis: one row
        ([(2, 0, 3), (2, 4, 3)], 1),  # an empty piece
    ],
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_values(backend, rng, shapes, dim, dtype):
    arrays = [_array(rng, shape) for shape in shapes]
    pieces = [fl.tensor(array).to(getattr(fl, dtype)) * 1.0 for array in arrays]
    got = fl.cat(pieces, dim).float().numpy()
    expected = np.concatenate([p.float().numpy() for p in pieces], axis=dim)
    np.testing.assert_array_equal(got, expected)


def test_permuted_pieces_values(backend, rng):
    a, b = _array(rng, (2, 5, 6, 8)), _array(rng, (2, 5, 6, 3))
    joined = fl.cat(
        [fl.tensor(a).exp().permute(0, 3, 1, 2), fl.tensor(b).exp().permute(0, 3, 1, 2)], 1
    )
    expected = np.concatenate([np.exp(a), np.exp(b)], axis=3).transpose(0, 3, 1, 2)
    np.testing.assert_allclose(joined.numpy(), expected, rtol=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64"])
def test_strided_pieces_and_pads(backend, rng, dtype):
    """Pieces in different orders (a transposed one, a sliced one) and a pad's interior go
    through the strided copy kernel."""
    a = fl.tensor(_array(rng, (4, 6, 8))).to(getattr(fl, dtype))
    b = fl.tensor(_array(rng, (4, 8, 6))).to(getattr(fl, dtype))
    c = fl.tensor(_array(rng, (4, 6, 16))).to(getattr(fl, dtype))
    pieces = [a * 1, (b * 1).permute(0, 2, 1), (c * 1)[:, :, 1::2], (c * 1)[:, :, :3]]
    joined = fl.cat(pieces, 2)
    expected = np.concatenate([p.numpy() for p in pieces], axis=2)
    np.testing.assert_array_equal(joined.numpy(), expected)
    padded = fl.nn.functional.pad((b * 1).permute(0, 2, 1), (1, 2, 3, 0), value=0.0)
    np.testing.assert_array_equal(
        padded.numpy(), np.pad(expected[:, :, 8:16], ((0, 0), (3, 0), (1, 2)))
    )


@pytest.mark.gpu
def test_a_captured_step_joins(cuda_backend, rng):
    """The join kernel inside a compiled step replayed as a CUDA graph (CuPy's concatenate
    could not be captured)."""
    weight = fl.tensor(_array(rng, (12, 5)), requires_grad=True)
    x = fl.tensor(_array(rng, (7, 5)))

    @fl.compile(cuda_graph=True)
    def step(x):
        h = x @ weight.T
        first, second, third = h.chunk(3, -1)
        loss = (first * 1.0 + second * 2.0 + third * 3.0).square().sum()
        loss.backward()
        return weight.grad * 1.0

    expected = None
    for _ in range(3):
        grad = step(x).numpy()
        weight.grad = None
        if expected is None:
            expected = grad
        np.testing.assert_allclose(grad, expected, rtol=1e-6)
    h = x.numpy() @ weight.numpy().T
    scale = np.repeat([1.0, 2.0, 3.0], 4)
    reference = (2 * (h[:, :4] + 2 * h[:, 4:8] + 3 * h[:, 8:]))[:, np.tile(np.arange(4), 3)]
    np.testing.assert_allclose(expected, (reference * scale).T @ x.numpy(), rtol=1e-4)
