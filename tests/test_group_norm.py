"""GroupNorm against PyTorch: the UNet block ``silu(group_norm(x, G, w, b)) + t`` with a
per-(N, C) time embedding ``t [N, C, 1, 1]``, forward values and the gradients of x, w, b
and t, for groups of 1 to 32 channels, NCHW and channels-last input (an NCHW view of an
NHWC tensor, as a channels-last conv writes it; ``memory_format=torch.channels_last`` in
PyTorch), in float32, float16 and bfloat16.

The reference is PyTorch in float64 on the very values FLAME gets (16-bit inputs are rounded
first, then upcast); the output dtype is PyTorch's for the same dtype, computed in that
dtype. Each test runs on the reference backend (CPU tier) and on the GPU (gpu tier)."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

import flame as fl
import flame.nn.functional as F
from flame.ir import dtypes
from flame.nn import GroupNorm

# (channels, groups): 1, 2, 4, 8 and 32 channels a group
GROUPINGS = [(8, 8), (16, 8), (16, 4), (32, 4), (64, 2)]
SPATIAL = [(5, 5), (8, 8), (7, 5)]  # 7 x 5: odd, and not square
DTYPES = ["float32", "float16", "bfloat16"]
LAYOUTS = ["nchw", "channels_last"]
# error allowed, relative to the largest magnitude of the reference value
TOLERANCE = {"float32": 2e-5, "float16": 2e-2, "bfloat16": 2e-2}
EPS = 1e-5


@pytest.fixture
def torch():
    return pytest.importorskip("torch", reason="GroupNorm is checked against PyTorch's")


def rounded(array: np.ndarray, dtype: str) -> np.ndarray:
    """``array`` stored in ``dtype`` (NumPy, or ml_dtypes for bfloat16)."""
    return array.astype(dtypes.dtype(dtype).numpy)


def flame_input(array: np.ndarray, layout: str) -> fl.Tensor:
    """An NCHW tensor over ``array``; channels-last: a permuted view of an NHWC copy."""
    if layout == "channels_last":
        return fl.from_numpy(np.ascontiguousarray(array.transpose(0, 2, 3, 1))).permute(0, 3, 1, 2)
    return fl.from_numpy(np.ascontiguousarray(array))


def torch_input(torch, array: np.ndarray, layout: str, dtype=None):
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if dtype is not None:
        tensor = tensor.to(dtype)
    if layout == "channels_last":
        tensor = tensor.contiguous(memory_format=torch.channels_last)
    return tensor


def as_float64(tensor: fl.Tensor) -> np.ndarray:
    return np.asarray(tensor.numpy()).astype(np.float64)


def assert_close(got: fl.Tensor, expected: np.ndarray, dtype: str, what: str) -> None:
    assert tuple(got.shape) == expected.shape, f"{what}: shape {list(got.shape)}"
    tolerance = TOLERANCE[dtype]
    scale = max(float(np.abs(expected).max()), 1e-30)
    np.testing.assert_allclose(
        as_float64(got), expected, rtol=tolerance, atol=tolerance * scale,
        err_msg=f"{what} ({dtype}; largest reference magnitude {scale:.3g})",
    )  # fmt: skip


def unet_inputs(rng, channels: int, height: int, width: int, dtype: str) -> dict:
    """x, w, b, the time embedding and the cotangent, stored in ``dtype``; x with a mean and
    a spread that differ per channel, as a conv's output has."""
    shape = (2, channels, height, width)
    offsets = rng.standard_normal((1, channels, 1, 1)) * 2.0
    spreads = 0.5 + rng.random((1, channels, 1, 1)) * 2.0
    arrays = {
        "x": rng.standard_normal(shape) * spreads + offsets,
        "w": 1.0 + 0.5 * rng.standard_normal(channels),
        "b": 0.5 * rng.standard_normal(channels),
        "t": rng.standard_normal((2, channels, 1, 1)),
        "gy": rng.standard_normal(shape),
    }
    return {key: rounded(value.astype(np.float32), dtype) for key, value in arrays.items()}


def torch_reference(torch, arrays: dict, groups: int, layout: str):
    """PyTorch in float64 on the same (rounded) values: the output and the gradients of
    ``sum(out * gy)`` with respect to x, w, b, t."""
    leaves = {
        key: torch_input(torch, arrays[key].astype(np.float64), layout if key == "x" else "nchw")
        for key in ("x", "w", "b", "t")
    }
    for leaf in leaves.values():
        leaf.requires_grad_(True)
    tf = torch.nn.functional
    out = tf.silu(tf.group_norm(leaves["x"], groups, leaves["w"], leaves["b"], EPS)) + leaves["t"]
    (out * torch.from_numpy(arrays["gy"].astype(np.float64))).sum().backward()
    grads = {key: leaf.grad.numpy() for key, leaf in leaves.items()}
    return out.detach().numpy(), grads


def torch_result_dtype(torch, arrays: dict, groups: int, layout: str, dtype: str) -> str:
    """The dtype of PyTorch's ``silu(group_norm(x, G, w, b)) + t`` computed in ``dtype``."""
    torch_dtype = getattr(torch, dtype)
    x = torch_input(torch, arrays["x"].astype(np.float32), layout, torch_dtype)
    w, b, t = (
        torch.from_numpy(arrays[key].astype(np.float32)).to(torch_dtype) for key in ("w", "b", "t")
    )
    tf = torch.nn.functional
    out = tf.silu(tf.group_norm(x, groups, w, b, EPS)) + t
    return dtypes.dtype(out.dtype).name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("height", "width"), SPATIAL, ids=lambda size: str(size))
@pytest.mark.parametrize(
    ("channels", "groups"), GROUPINGS, ids=[f"{c // g}-per-group" for c, g in GROUPINGS]
)
def test_group_norm_silu_time_embedding(
    channels, groups, height, width, layout, dtype, backend, torch, rng
):
    arrays = unet_inputs(rng, channels, height, width, dtype)
    expected, expected_grads = torch_reference(torch, arrays, groups, layout)

    x = flame_input(arrays["x"], layout)
    w, b, t = (fl.from_numpy(arrays[key]) for key in ("w", "b", "t"))

    def block(x, w, b, t):
        return F.silu(F.group_norm(x, groups, w, b, EPS)) + t

    out, pullback = fl.vjp(block, x, w, b, t)
    grads = dict(zip("xwbt", pullback(fl.from_numpy(arrays["gy"])), strict=True))

    want = torch_result_dtype(torch, arrays, groups, layout, dtype)
    assert out.dtype.name == want, f"output dtype {out.dtype.name}, PyTorch gives {want}"
    for key, grad in grads.items():
        assert grad.dtype.name == dtype, f"gradient of {key}: {grad.dtype.name}, not {dtype}"
    assert_close(out, expected, dtype, "output")
    for key in "xwbt":
        assert_close(grads[key], expected_grads[key], dtype, f"gradient of {key}")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("channels", "groups"), [(6, 3), (8, 1), (8, 8)])
def test_group_norm_module_without_affine(channels, groups, layout, backend, torch, rng):
    """``flame.nn.GroupNorm(affine=False)``: no parameters, and the plain normalisation
    (each group to mean 0, variance 1) with its input gradient."""
    module = GroupNorm(groups, channels, affine=False)
    assert module.weight is None and module.bias is None
    assert dict(module.state_dict()) == {}
    if "bias" in inspect.signature(torch.nn.GroupNorm).parameters:
        # FLAME prints PyTorch 2.13's repr (with bias=); older PyTorch has no such argument
        assert repr(module) == repr(torch.nn.GroupNorm(groups, channels, affine=False))

    shape = (2, channels, 7, 5)
    x_array = (rng.standard_normal(shape) * 3.0 + 1.5).astype(np.float32)
    gy = rng.standard_normal(shape).astype(np.float32)
    x64 = torch_input(torch, x_array.astype(np.float64), layout).requires_grad_(True)
    reference = torch.nn.GroupNorm(groups, channels, eps=module.eps, affine=False)(x64)
    (reference * torch.from_numpy(gy.astype(np.float64))).sum().backward()

    out, pullback = fl.vjp(module, flame_input(x_array, layout))
    (grad,) = pullback(fl.from_numpy(gy))
    assert out.dtype.name == "float32"
    assert_close(out, reference.detach().numpy(), "float32", "output")
    assert_close(grad, x64.grad.numpy(), "float32", "gradient of x")


def test_channels_not_divisible_by_groups_is_refused(reference_backend):
    x = fl.from_numpy(np.ones((2, 6, 3, 3), np.float32))
    with pytest.raises(ValueError, match=r"group_norm.*\[2, 6, 3, 3\].*4 groups") as info:
        F.group_norm(x, 4)
    assert "divide" in str(info.value)
    with pytest.raises(ValueError, match=r"group_norm.*\[2, 6, 3, 3\].*4 groups"):
        F.group_norm(x, 4, fl.ones(6), fl.zeros(6))
    # the module refuses at construction, with PyTorch's words
    with pytest.raises(
        ValueError, match=r"num_channels \(6\) must be divisible by num_groups \(4\)"
    ):
        GroupNorm(4, 6)


def test_input_without_a_channel_axis_is_refused(reference_backend):
    with pytest.raises(ValueError, match=r"group_norm.*\[6\]"):
        F.group_norm(fl.from_numpy(np.ones(6, np.float32)), 2)


def test_weight_of_another_channel_count_is_refused_naming_group_norm(reference_backend):
    """A module built for 4 channels on a 6-channel input (PyTorch: "Expected weight to be
    a vector of size equal to the number of channels in input, but got weight of shape [4]
    and input of shape [2, 6, 3, 3]"): the error names group_norm and both shapes."""
    x = fl.from_numpy(np.ones((2, 6, 3, 3), np.float32))
    with pytest.raises(ValueError) as info:
        F.group_norm(x, 2, fl.ones(4), fl.zeros(4))
    message = str(info.value)
    assert "group_norm" in message and "[4]" in message and "[2, 6, 3, 3]" in message, message
