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


def test_channels_last_group_norm_writes_what_the_next_conv_reads(cuda_backend):
    """Channels innermost (a channels-last conv's result): copied to the group-major order,
    normalised by one row kernel, and the affine, SiLU, embedding and cast in one elementwise
    kernel that writes channels-last memory for the next conv."""
    x = tensor(2, 8, 8, 32).permute(0, 3, 1, 2)
    out = unet_block(x, tensor(32), tensor(32), tensor(2, 32, 1, 1)).permute(0, 2, 3, 1)
    graph, kernels = planned(out)
    assert [g.kind for g in kernels] == ["elementwise", "reduce", "elementwise"], graph.groups
    assert {"silu", "cast", "add"} <= {node.op for node in kernels[2].nodes}
    assert tuple(kernels[2].outputs[0].shape) == (2, 8, 8, 32)


def _channels_last_statistics(x, groups):
    """GroupNorm's statistics on channels-innermost memory, per channel over the positions,
    then per group (a formulation tried for issue 21, kept here for the graph its backward
    makes)."""
    rows = x.permute(0, 2, 3, 1).reshape(x.shape[0], -1, groups, x.shape[1] // groups)
    shift = rows[:, :1].detach()
    deviation = rows - shift
    first = fl.mean(deviation, 1, keepdim=True)
    second = fl.mean(deviation * deviation, 1, keepdim=True)
    channel_mean = shift + first
    mean = fl.mean(channel_mean, 3, keepdim=True)
    spread = channel_mean - mean
    variance = fl.mean(second - first * first + spread * spread, 3, keepdim=True)
    return (rows - mean) * (variance + 1e-5).rsqrt()


def test_every_kernel_output_is_computed_by_a_kernel(cuda_backend):
    """A saved reduction joins the kernel of its anchor only if that kernel reduces: in this
    backward graph the save-or-recompute pass once put a reduce_sum into an elementwise
    kernel, which listed it as an output without computing it (the GPU read garbage)."""
    x = tensor(2, 5, 5, 16).permute(0, 3, 1, 2)
    out, pullback = fl.vjp(lambda x: F.silu(_channels_last_statistics(x, 4)), x)
    (dx,) = pullback(tensor(2, 25, 4, 4))
    graph = run_pipeline(Graph((dx.node,)))
    for group in graph.groups:
        members = {id(node) for node in group.nodes}
        missing = [node.op for node in group.outputs if id(node) not in members]
        assert not missing, f"{group.kind} kernel writes {missing} without computing them"


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


@pytest.mark.gpu
def test_reshape_of_a_strided_input_reads_a_copy(cuda_backend):
    """A channels-last tensor from PyTorch (DLPack keeps its strides) viewed in an order no
    strides express: reshaped and group-normalised, it is read through a copy."""
    torch = pytest.importorskip("torch", reason="PyTorch makes the channels-last input")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch has no CUDA here: no channels-last tensor to share")
    x = torch.randn(2, 32, 5, 5, device="cuda").to(memory_format=torch.channels_last)
    ours = fl.from_dlpack(x)
    np.testing.assert_array_equal(ours.reshape(2, -1).numpy(), x.reshape(2, -1).cpu().numpy())
    want = torch.nn.functional.group_norm(x, 8).cpu().numpy()
    np.testing.assert_allclose(F.group_norm(ours, 8).numpy(), want, rtol=1e-4, atol=1e-5)
