"""GroupNorm and what follows it as one row kernel (issue 21): ``lift_row_epilogues`` moves
elementwise work after a row kernel's reshape onto its rows; the fused graph is checked here
(CPU tier: the pipeline and kernel lowering) and its values against PyTorch in
tests/test_group_norm.py (both tiers)."""

import numpy as np
import pytest

import flame as fl
import flame.nn.functional as F
from flame.codegen.lower import lower_group
from flame.ir.graph import Graph
from flame.ir.passes import run_pipeline
from flame.runtime.executor import _layout_of


def planned(*tensors):
    graph = run_pipeline(Graph(tuple(t.node for t in tensors)))
    views = ("reshape", "permute")  # outputs handed out as views of a kernel's buffer
    kernels = [g for g in graph.groups if g.kind != "library" or g.nodes[0].op not in views]
    return graph, kernels


def tensor(*shape, dtype=np.float32):
    return fl.tensor(np.random.default_rng(0).standard_normal(shape).astype(dtype))


def unet_block(x, weight, bias, embedding):
    """A UNet ResBlock's GroupNorm(8) + SiLU + time-embedding add + bf16 cast."""
    return (F.silu(F.group_norm(x, 8, weight, bias)) + embedding).to(fl.bfloat16)


def test_group_norm_silu_embedding_cast_is_one_kernel(cuda_backend):
    out = unet_block(tensor(2, 32, 8, 8), tensor(32), tensor(32), tensor(2, 32, 1, 1))
    graph, kernels = planned(out)
    assert [g.kind for g in kernels] == ["reduce"], [g.kind for g in graph.groups]
    ops = {node.op for node in kernels[0].nodes}
    assert {"silu", "cast", "rsqrt", "reduce_sum"} <= ops
    (written,) = kernels[0].outputs
    assert written.dtype is fl.bfloat16 and written.numel == out.numel()
    spec = lower_group(kernels[0], _layout_of).spec
    assert spec.extras["cache_items"] and spec.vec == 4, spec.size_class  # rows in registers


def test_channels_last_group_norm_reads_twice_and_writes_channels_last(cuda_backend):
    """Channels innermost: per-channel sums over the positions (one pass, coalesced), the
    group's combination, then one elementwise kernel with the affine, SiLU, embedding and
    cast that writes [N, H, W, C] memory, handed out as the permuted view (no copy)."""
    x = tensor(2, 8, 8, 32).permute(0, 3, 1, 2)
    out = unet_block(x, tensor(32), tensor(32), tensor(2, 32, 1, 1))
    graph, kernels = planned(out)
    assert [g.kind for g in kernels] == ["reduce", "reduce", "elementwise"], graph.groups
    (written,) = kernels[2].outputs
    assert written.dtype is fl.bfloat16 and written.numel == out.numel()
    assert {"silu", "cast", "add"} <= {node.op for node in kernels[2].nodes}
    assert tuple(written.shape) == (2, 64, 8, 4)  # [N, S, G, C/G]: channels innermost


def test_operands_computed_elsewhere_are_not_lifted(cuda_backend):
    """A value computed by other elementwise ops stays in its own shape: lifting would force
    it into memory; the sum after the norm then runs as a second kernel."""
    x, other = tensor(2, 32, 4, 4), tensor(2, 32, 4, 4)
    out = F.group_norm(x, 8) + (other * 2.0).exp()
    _, kernels = planned(out)
    assert len(kernels) == 2


@pytest.mark.parametrize("hw", [(8, 8), (7, 5)])
def test_group_norm_backward_reads_the_data_twice(hw, cuda_backend):
    """dx in one row kernel, dw and db in one more: two passes over x and dy."""
    x = tensor(2, 32, *hw)
    weight, bias, dy = tensor(32), tensor(32), tensor(2, 32, *hw)
    _, back = fl.vjp(lambda x, w, b: F.silu(F.group_norm(x, 8, w, b)), x, weight, bias)
    dx, dw, db = back(dy)
    _, kernels = planned(dx, dw, db)
    assert [g.kind for g in kernels] == ["reduce", "reduce"], [g.kind for g in kernels]
