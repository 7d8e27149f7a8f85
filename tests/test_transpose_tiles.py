"""Elementwise kernels that change the memory order (NCHW <-> NHWC) go through shared-memory
tiles (flame/codegen/transpose.py): the choice and the code in the CPU tier (lowered,
rendered and compiled with NVRTC without a GPU), the values on both backends."""

from __future__ import annotations

import numpy as np
import pytest

import flame as fl
from flame.codegen.lower import lower_group
from flame.codegen.render import render, spec_key
from flame.ir.graph import Graph
from flame.ir.passes import run_pipeline
from flame.runtime.compiler import nvrtc_compile
from flame.runtime.executor import _layout_of

TO_LAST = (0, 2, 3, 1)  # NCHW -> NHWC
TO_FIRST = (0, 3, 1, 2)


def _kernels(*outputs):
    graph = run_pipeline(Graph(tuple(t.node for t in outputs)))
    return [lower_group(g, _layout_of) for g in graph.groups if g.kind == "elementwise"]


def _layout_change(shape, dims, rng):
    """``x`` laid out in ``shape``, its permute by ``dims`` scaled, shifted by a per-channel
    bias (broadcast along the new order's innermost axis) and cast: one kernel that reads
    ``x`` in another order than it writes."""
    x = fl.tensor(rng.standard_normal(shape).astype(np.float32))
    bias = fl.tensor(rng.standard_normal(shape[dims[-1]]).astype(np.float32))
    return x, bias, (fl.permute(x, dims) * 3.0 + bias).to(fl.bfloat16).clone()


def test_a_layout_change_is_tiled_and_compiles(cuda_backend, nvrtc, rng):
    _, _, y = _layout_change((4, 64, 8, 8), TO_LAST, rng)
    (kernel,) = _kernels(y)
    assert kernel.spec.template == "transpose.cu.j2", kernel.spec.size_class
    assert "tiled transpose" in kernel.spec.size_class
    source = render(kernel.spec)
    assert "__shared__" in source and "__syncthreads()" in source
    nvrtc_compile(source, kernel.spec.name, "sm_90")
    # a grid of tiles: 4 images x the channel tiles x the position tiles (64 of each)
    tile = kernel.spec.extras["tile"]
    assert kernel.grid_items == 4 * (64 // tile) ** 2 and kernel.threads == tile * 8


def test_many_transposed_operands_fit_in_shared_memory(cuda_backend, nvrtc, rng):
    """Each transposed operand takes a tile of shared memory: past the static limit the tile
    shrinks, then the last operands are read in place (the UNet's optimizer-side kernels
    read a dozen transposed values)."""
    values = [
        fl.permute(fl.tensor(rng.standard_normal((2, 64, 8, 8)).astype(np.float32)), TO_LAST)
        for _ in range(12)
    ]
    total = values[0]
    for value in values[1:]:
        total = total * 0.5 + value
    (kernel,) = _kernels(total.clone())
    assert kernel.spec.template == "transpose.cu.j2"
    source = render(kernel.spec)
    assert source.count("__shared__") < 12
    nvrtc_compile(source, kernel.spec.name, "sm_90")


def test_kernels_in_one_order_stay_plain(cuda_backend, rng):
    x = fl.tensor(rng.standard_normal((4, 64, 8, 8)).astype(np.float32))
    (kernel,) = _kernels((x * 2.0 + 1.0).clone())
    assert kernel.spec.template == "elementwise.cu.j2"
    # the transposed axis too short to tile (3 channels): the plain kernel
    small = fl.tensor(rng.standard_normal((4, 3, 32, 32)).astype(np.float32))
    (kernel,) = _kernels((fl.permute(small, TO_LAST) * 2.0).clone())
    assert kernel.spec.template == "elementwise.cu.j2"


def test_sizes_are_arguments(cuda_backend, rng):
    """Shapes of one layout change (odd sizes, partial tiles) share one kernel per size class
    (pairs where the tiled sizes are even, one element a thread where one is odd); a batch
    of one is another collapsed rank (its axis is dropped), so another kernel."""
    for shapes in (((2, 64, 8, 8), (3, 40, 18, 22), (5, 34, 6, 10)),
                   ((3, 40, 17, 19), (5, 33, 5, 7))):  # fmt: skip
        keys = set()
        for shape in shapes:
            _, _, y = _layout_change(shape, TO_LAST, rng)
            (kernel,) = _kernels(y)
            assert kernel.spec.template == "transpose.cu.j2", shape
            keys.add(spec_key(kernel.spec))
        assert len(keys) == 1, shapes


@pytest.mark.parametrize("dims", [TO_LAST, TO_FIRST], ids=["to_nhwc", "to_nchw"])
@pytest.mark.parametrize("shape", [(2, 64, 8, 8), (3, 40, 17, 19), (1, 33, 5, 7)])
def test_values(backend, rng, shape, dims):
    x, bias, y = _layout_change(shape, dims, rng)
    x_np, bias_np = x.numpy(), bias.numpy()
    expected = (np.transpose(x_np, dims) * 3.0 + bias_np).astype(np.float32)
    got = y.float().numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-2, atol=1e-2)  # bf16 output


def test_values_with_two_outputs_and_an_operand_in_order(backend, rng):
    """A tiled kernel also reads operands already in the output's order, and writes two
    outputs."""
    x = fl.tensor(rng.standard_normal((2, 48, 20, 20)).astype(np.float32))
    other = fl.tensor(rng.standard_normal((2, 20, 20, 48)).astype(np.float32))
    moved = fl.permute(x, TO_LAST)
    total, product = moved + other, (moved * other).to(fl.float16)
    if backend == "cuda":
        kernels = _kernels(total, product)
        assert [k.spec.template for k in kernels] == ["transpose.cu.j2"]
    expected = np.transpose(x.numpy(), TO_LAST)
    np.testing.assert_allclose(total.numpy(), expected + other.numpy(), rtol=1e-6)
    np.testing.assert_allclose(
        product.float().numpy(), expected * other.numpy(), rtol=2e-3, atol=2e-3
    )


def _bf16_layout_change(shape, dims, rng, offset=0):
    """A 16-bit value (its last axis sliced from ``offset``) copied into another order,
    plus one in-order operand: the kernel reads the transposed operand in pairs."""
    values = rng.standard_normal((*shape[:-1], shape[-1] + offset)).astype(np.float32)
    x = fl.tensor(values, dtype=fl.bfloat16)
    x = x[..., offset:] if offset else x
    moved = fl.permute(x, dims)
    other = fl.tensor(rng.standard_normal(moved.shape).astype(np.float32), dtype=fl.bfloat16)
    return x, other, (moved + other).clone()


def test_16_bit_transposes_move_vectors(cuda_backend, nvrtc, rng):
    """16-bit operands and outputs go four elements a thread in both phases (8-byte loads
    and stores), two where the tiled sizes are only even, one where one is odd: three named
    size classes, each compiled."""
    keys = set()
    for channels, lanes in ((64, 4), (62, 2), (63, 1)):
        _, _, y = _bf16_layout_change((4, channels, 8, 8), TO_LAST, rng)
        (kernel,) = _kernels(y)
        assert kernel.spec.template == "transpose.cu.j2" and kernel.spec.vec == lanes
        assert f"{lanes} lanes" in kernel.spec.size_class
        source = render(kernel.spec)
        if lanes > 1:
            assert f"FlameVec<unsigned short, {lanes}>" in source
        assert "__shared__ unsigned short" in source  # tiles hold the stored 16-bit values
        nvrtc_compile(source, kernel.spec.name, "sm_90")
        keys.add(spec_key(kernel.spec))
    assert len(keys) == 3
    # a view starting at an odd element cannot be read in aligned vectors
    _, _, shifted = _bf16_layout_change((2, 64, 8, 16), TO_LAST, rng, offset=1)
    (unaligned,) = _kernels(shifted)
    assert unaligned.spec.template == "transpose.cu.j2" and unaligned.spec.vec == 1


def test_a_dozen_16_bit_transposed_operands_share_shared_memory(cuda_backend, rng):
    """An optimizer-like kernel reading twelve transposed 16-bit gradients keeps every one
    in a shared-memory tile (2 bytes a value): none is read in place."""
    grads = [
        fl.permute(fl.tensor(rng.standard_normal((96, 160)).astype(np.float32),
                             dtype=fl.bfloat16), (1, 0))
        for _ in range(12)
    ]  # fmt: skip
    params = [fl.tensor(rng.standard_normal((160, 96)).astype(np.float32)) for _ in range(12)]
    updated = [p - 0.1 * g.float() for p, g in zip(params, grads)]
    (kernel,) = _kernels(*updated)
    assert kernel.spec.template == "transpose.cu.j2"
    assert render(kernel.spec).count("__shared__ unsigned short") == 12


@pytest.mark.parametrize("dims", [TO_LAST, TO_FIRST], ids=["to_nhwc", "to_nchw"])
@pytest.mark.parametrize(
    "shape,offset",
    [
        ((2, 64, 8, 8), 0),
        ((3, 40, 18, 22), 0),
        ((2, 62, 6, 10), 0),
        ((2, 66, 10, 16), 1),
        ((1, 33, 5, 7), 0),
    ],
)
def test_16_bit_values(backend, rng, shape, dims, offset):
    """Fours, pairs, partial tiles, odd sizes and a view at an offset: bit-exact with NumPy."""
    x, other, y = _bf16_layout_change(shape, dims, rng, offset)
    fl.realize(y)  # written as bfloat16 (a fused read-back would keep the float32 sum)
    expected = np.transpose(x.float().numpy(), dims).astype(np.float32) + other.float().numpy()
    expected = fl.tensor(expected).to(fl.bfloat16).float().numpy()
    np.testing.assert_array_equal(y.float().numpy(), expected)
