"""The functional ops of the nn layers (issue 19): flame/nn/convolution.py, pooling.py,
interpolation.py, attention.py, normalization.py.

Without PyTorch: conv2d against a direct summation in NumPy, conv_transpose2d and fold as
the adjoints of conv2d and unfold, pooling and interpolate against NumPy loops, attention
against a NumPy softmax, batch_norm's running statistics against PyTorch's formula, and the
errors. With PyTorch (skipped where it is not importable): values and gradients of every op
over a grid of arguments. GPU tier: a handful of each on the cuda backend against the
reference backend.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from gradcheck import check_against_finite_differences, check_against_torch

import flame as fl
from flame.nn import attention, convolution, folding, multihead_attention, normalization, pooling


def torch_module():
    return pytest.importorskip("torch", reason="PyTorch is the reference for these checks")


def _random(rng, *shape) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


# --- conv2d without PyTorch --------------------------------------------------------------------


def numpy_conv2d(x, w, b, stride, padding, dilation, groups):
    """Direct summation over every output position, channel and tap (float64)."""
    (sh, sw), (dh, dw) = stride, dilation
    (top, bottom), (left, right) = padding
    padded = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (top, bottom), (left, right)))
    batch, _, height, width = padded.shape
    out_channels, per_group, kh, kw = w.shape
    out_h = (height - dh * (kh - 1) - 1) // sh + 1
    out_w = (width - dw * (kw - 1) - 1) // sw + 1
    out = np.zeros((batch, out_channels, out_h, out_w))
    for n, o, y, z in np.ndindex(batch, out_channels, out_h, out_w):
        group = o // (out_channels // groups)
        total = 0.0 if b is None else float(b[o])
        for c, i, j in np.ndindex(per_group, kh, kw):
            total += (
                w[o, c, i, j] * padded[n, group * per_group + c, y * sh + i * dh, z * sw + j * dw]
            )
        out[n, o, y, z] = total
    return out


CONV_NUMPY_CASES = [
    # (stride, padding, dilation, groups, bias)
    (1, 0, 1, 1, True),
    (2, 1, 1, 2, False),
    (1, "same", 2, 1, True),
    ((2, 1), (1, 0), (1, 2), 4, True),
    (1, "valid", 1, 2, False),
]


@pytest.mark.parametrize("case", CONV_NUMPY_CASES, ids=str)
def test_conv2d_matches_direct_summation(case, rng, reference_backend):
    stride, padding, dilation, groups, with_bias = case
    x, w = _random(rng, 2, 4, 7, 6), _random(rng, 4, 4 // groups, 3, 2)
    b = _random(rng, 4) if with_bias else None
    result = convolution.conv2d(
        fl.from_numpy(x), fl.from_numpy(w), None if b is None else fl.from_numpy(b),
        stride, padding, dilation, groups,
    )  # fmt: skip
    pairs_stride = convolution.int_tuple(stride, 2, "t", "stride")
    pairs_dilation = convolution.int_tuple(dilation, 2, "t", "dilation")
    if padding == "same":
        pairs = tuple(
            (d * (k - 1) // 2, d * (k - 1) - d * (k - 1) // 2)
            for k, d in zip((3, 2), pairs_dilation)
        )
    elif padding == "valid":
        pairs = ((0, 0), (0, 0))
    else:
        pairs = tuple((p, p) for p in convolution.int_tuple(padding, 2, "t", "padding"))
    expected = numpy_conv2d(x, w, b, pairs_stride, pairs, pairs_dilation, groups)
    if padding == "same":
        assert result.shape == x.shape[:1] + (4,) + x.shape[2:]
    np.testing.assert_allclose(result.numpy(), expected, rtol=1e-4, atol=1e-5)


def test_conv2d_gradients_match_finite_differences(rng):
    arrays = [_random(rng, 1, 2, 5, 4), _random(rng, 4, 1, 2, 3), _random(rng, 4)]

    def build(x, w, b):
        return convolution.conv2d(x, w, b, stride=(2, 1), padding=1, dilation=(1, 2), groups=2)

    check_against_finite_differences(build, arrays, [0, 1, 2], rng, rtol=1e-5, atol=1e-6)


def _inner(a: fl.Tensor, b: fl.Tensor) -> float:
    return float(np.sum(a.numpy().astype(np.float64) * b.numpy().astype(np.float64)))


@pytest.mark.parametrize(
    "stride, padding, dilation, groups", [(1, 0, 1, 1), (2, 1, 1, 2), (3, 2, 2, 1), (2, 0, 2, 2)]
)
def test_conv_transpose2d_is_the_adjoint_of_conv2d(
    stride, padding, dilation, groups, rng, reference_backend
):
    """<conv2d(x, w), y> == <x, conv_transpose2d(y, w)> for the matching sizes."""
    x = fl.from_numpy(_random(rng, 2, 4, 9, 8))
    w = fl.from_numpy(_random(rng, 6, 4 // groups, 3, 2))
    forward = convolution.conv2d(x, w, None, stride, padding, dilation, groups)
    y = fl.from_numpy(_random(rng, *forward.shape))
    sizes = [
        x.shape[2 + axis]
        - (
            (forward.shape[2 + axis] - 1) * stride
            - 2 * padding
            + dilation * (w.shape[2 + axis] - 1)
            + 1
        )
        for axis in range(2)
    ]
    backward = convolution.conv_transpose2d(
        y, w, None, stride, padding, tuple(sizes), groups, dilation
    )
    assert backward.shape == x.shape
    assert _inner(forward, y) == pytest.approx(_inner(x, backward), rel=1e-4)


def test_fold_is_the_adjoint_of_unfold(rng, reference_backend):
    x = fl.from_numpy(_random(rng, 2, 3, 7, 8))
    columns = folding.unfold(x, (2, 3), dilation=2, padding=1, stride=(2, 1))
    y = fl.from_numpy(_random(rng, *columns.shape))
    folded = folding.fold(y, (7, 8), (2, 3), dilation=2, padding=1, stride=(2, 1))
    assert folded.shape == x.shape
    assert _inner(columns, y) == pytest.approx(_inner(x, folded), rel=1e-4)


def test_unfold_orders_channels_then_taps(rng, reference_backend):
    x = _random(rng, 1, 2, 3, 3)
    columns = folding.unfold(fl.from_numpy(x), 2).numpy()
    assert columns.shape == (1, 8, 4)
    # row c*4 + i*2 + j holds x[c, y+i, z+j] for block (y, z) at column y*2 + z
    expected = np.stack(
        [
            x[0, c, i : i + 2, j : j + 2].reshape(-1)
            for c in range(2)
            for i in range(2)
            for j in range(2)
        ]
    )
    np.testing.assert_array_equal(columns[0], expected)


def test_linear_and_conv1d_without_torch(rng, reference_backend):
    x, w, b = _random(rng, 3, 5, 4), _random(rng, 6, 4), _random(rng, 6)
    result = convolution.linear(fl.from_numpy(x), fl.from_numpy(w), fl.from_numpy(b))
    np.testing.assert_allclose(result.numpy(), x @ w.T + b, rtol=1e-5, atol=1e-5)
    signal, kernel = _random(rng, 2, 4, 9), _random(rng, 6, 2, 3)
    result = convolution.conv1d(fl.from_numpy(signal), fl.from_numpy(kernel), None, 2, 1, 2, 2)
    expected = numpy_conv2d(
        signal[:, :, None], kernel[:, :, None], None, (1, 2), ((0, 0), (1, 1)), (1, 2), 2
    )
    np.testing.assert_allclose(result.numpy(), expected[:, :, 0], rtol=1e-4, atol=1e-5)


# --- pooling, pixel shuffle and interpolate without PyTorch --------------------------------------


def test_pools_match_numpy_windows(rng, reference_backend):
    x = _random(rng, 2, 3, 6, 7)
    tensor = fl.from_numpy(x)
    average = pooling.avg_pool2d(tensor, 3, 2, 1, count_include_pad=False).numpy()
    largest = pooling.max_pool2d(tensor, 3, 2, 1).numpy()
    padded = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)), constant_values=np.nan)
    for y, z in np.ndindex(3, 4):
        window = padded[:, :, 2 * y : 2 * y + 3, 2 * z : 2 * z + 3]
        np.testing.assert_allclose(average[:, :, y, z], np.nanmean(window, (2, 3)), rtol=1e-5)
        np.testing.assert_allclose(largest[:, :, y, z], np.nanmax(window, (2, 3)))


def test_pixel_shuffle_round_trip_and_layout(rng, reference_backend):
    x = _random(rng, 2, 12, 3, 4)
    shuffled = pooling.pixel_shuffle(fl.from_numpy(x), 2)
    assert shuffled.shape == (2, 3, 6, 8)
    # out[n, c, 2h + i, 2w + j] = in[n, 4c + 2i + j, h, w]
    np.testing.assert_array_equal(
        shuffled.numpy()[1, 2, 2 * 1 + 1, 2 * 3 + 0], x[1, 4 * 2 + 2, 1, 3]
    )
    np.testing.assert_array_equal(pooling.pixel_unshuffle(shuffled, 2).numpy(), x)


def test_interpolate_nearest_and_bilinear_without_torch(rng, reference_backend):
    x = _random(rng, 1, 2, 3, 4)
    nearest = pooling.interpolate(fl.from_numpy(x), scale_factor=2).numpy()
    np.testing.assert_array_equal(nearest, x.repeat(2, axis=2).repeat(2, axis=3))
    corners = pooling.interpolate(
        fl.from_numpy(x), size=(5, 7), mode="bilinear", align_corners=True
    )
    values = corners.numpy()
    np.testing.assert_allclose(values[..., ::2, ::2], x, rtol=1e-6)  # the grid points stay
    np.testing.assert_allclose(values[..., 1, 0], (x[..., 0, 0] + x[..., 1, 0]) / 2, rtol=1e-5)


# --- attention without PyTorch -----------------------------------------------------------------


def _numpy_softmax(scores):
    shifted = np.exp(scores - scores.max(-1, keepdims=True))
    return shifted / shifted.sum(-1, keepdims=True)


def test_attention_matches_numpy(rng, reference_backend):
    q, k, v = _random(rng, 2, 3, 4, 8), _random(rng, 2, 3, 5, 8), _random(rng, 2, 3, 5, 6)
    keep = rng.random((4, 5)) > 0.3
    keep[:, 0] = True
    result = attention.scaled_dot_product_attention(
        fl.from_numpy(q),
        fl.from_numpy(k),
        fl.from_numpy(v),
        attn_mask=fl.from_numpy(keep),
        scale=0.5,
    )
    scores = np.where(keep, q @ k.swapaxes(-1, -2) * 0.5, -np.inf)
    np.testing.assert_allclose(result.numpy(), _numpy_softmax(scores) @ v, rtol=1e-5, atol=1e-6)


def test_attention_fully_masked_row_gives_zeros(rng, reference_backend):
    q, k, v = (fl.from_numpy(_random(rng, 1, 3, 4)) for _ in range(3))
    keep = np.ones((3, 3), dtype=bool)
    keep[1] = False
    result = attention.scaled_dot_product_attention(q, k, v, attn_mask=fl.from_numpy(keep))
    assert np.all(result.numpy()[0, 1] == 0) and np.isfinite(result.numpy()).all()


def test_attention_dropout_uses_flame_generator(rng, reference_backend):
    q, k, v = (fl.from_numpy(_random(rng, 2, 6, 4)) for _ in range(3))
    first = attention.scaled_dot_product_attention(q, k, v, dropout_p=0.5).numpy()
    fl.manual_seed(7)
    second = attention.scaled_dot_product_attention(q, k, v, dropout_p=0.5).numpy()
    fl.manual_seed(7)
    third = attention.scaled_dot_product_attention(q, k, v, dropout_p=0.5).numpy()
    np.testing.assert_array_equal(second, third)
    assert not np.array_equal(first, attention.scaled_dot_product_attention(q, k, v).numpy())


# --- batch_norm running statistics -------------------------------------------------------------


def _running_statistics_reference(batches, momentum):
    mean, var = np.zeros(3), np.ones(3)
    for batch in batches:
        count = batch.size // 3
        batch_mean = batch.mean((0, 2, 3))
        batch_var = batch.var((0, 2, 3)) * count / (count - 1)
        mean = (1 - momentum) * mean + momentum * batch_mean
        var = (1 - momentum) * var + momentum * batch_var
    return mean, var


@pytest.mark.parametrize("where", ["eager", "no_grad", "compile"])
def test_batch_norm_updates_running_statistics(where, rng, reference_backend):
    batches = [_random(rng, 4, 3, 2, 5) * (step + 1) + step for step in range(3)]
    running_mean, running_var = fl.zeros(3), fl.ones(3)

    def step(x):
        return normalization.batch_norm(x, running_mean, running_var, training=True, momentum=0.2)

    run = fl.compile(step) if where == "compile" else step
    for batch in batches:
        if where == "no_grad":
            with fl.no_grad():
                out = run(fl.from_numpy(batch))
        else:
            out = run(fl.from_numpy(batch))
        centered = batch - batch.mean((0, 2, 3), keepdims=True)
        expected = centered / np.sqrt(batch.var((0, 2, 3), keepdims=True) + 1e-5)
        np.testing.assert_allclose(out.numpy(), expected, rtol=1e-4, atol=1e-5)
    mean, var = _running_statistics_reference(batches, 0.2)
    np.testing.assert_allclose(running_mean.numpy(), mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(running_var.numpy(), var, rtol=1e-5, atol=1e-6)


def test_batch_norm_eval_uses_running_statistics(rng, reference_backend):
    x = _random(rng, 2, 3, 4)
    mean, var = np.array([0.5, -1, 2], np.float32), np.array([1, 4, 0.25], np.float32)
    result = normalization.batch_norm(fl.from_numpy(x), fl.from_numpy(mean), fl.from_numpy(var))
    expected = (x - mean[:, None]) / np.sqrt(var[:, None] + 1e-5)
    np.testing.assert_allclose(result.numpy(), expected, rtol=1e-5, atol=1e-6)


# --- errors ------------------------------------------------------------------------------------


def _zeros(*shape):
    return fl.zeros(shape)


CONV2D, CONV_T2D = convolution.conv2d, convolution.conv_transpose2d
SDPA = attention.scaled_dot_product_attention
IMAGE, WEIGHT = (1, 3, 5, 5), (4, 3, 3, 3)
ERROR_CASES = [
    ("conv2d channels", lambda: CONV2D(_zeros(*IMAGE), _zeros(4, 2, 3, 3)), fl.ShapeError,
     r"conv2d: input float32\[1, 3, 5, 5\] has 3 channels, but weight float32\[4, 2, 3, 3\]"),
    ("conv2d weight rank", lambda: CONV2D(_zeros(*IMAGE), _zeros(4, 3, 3)), fl.ShapeError,
     r"conv2d: expected a 4-d weight, got weight float32\[4, 3, 3\]"),
    ("conv2d groups", lambda: CONV2D(_zeros(*IMAGE), _zeros(3, 1, 3, 3), groups=2), ValueError,
     r"conv2d: out_channels 3 of weight float32\[3, 1, 3, 3\] is not divisible by groups=2"),
    ("conv2d groups channels", lambda: CONV2D(_zeros(*IMAGE), _zeros(6, 1, 3, 3), groups=2),
     fl.ShapeError, r"conv2d: input float32\[1, 3, 5, 5\] has 3 channels, but weight "
     r"float32\[6, 1, 3, 3\] with groups=2"),
    ("conv2d negative padding", lambda: CONV2D(_zeros(*IMAGE), _zeros(*WEIGHT), padding=-1),
     ValueError, r"conv2d: negative padding"),
    ("conv2d same strided",
     lambda: CONV2D(_zeros(*IMAGE), _zeros(*WEIGHT), stride=2, padding="same"),
     ValueError, r"padding='same' is not supported for strided"),
    ("conv2d too small", lambda: CONV2D(_zeros(1, 3, 2, 5), _zeros(*WEIGHT)), fl.ShapeError,
     r"conv2d: input float32\[1, 3, 2, 5\] padded by 0\+0 is smaller than the kernel"),
    ("conv2d bias", lambda: CONV2D(_zeros(*IMAGE), _zeros(*WEIGHT), _zeros(3)), fl.ShapeError,
     r"conv2d: bias must be 1-d with 4 entries"),
    ("conv1d input rank", lambda: convolution.conv1d(_zeros(*IMAGE), _zeros(4, 3, 3)),
     fl.ShapeError, r"conv1d: expected a 2-d \(unbatched\) or 3-d \(batched\) input"),
    ("conv_transpose2d channels", lambda: CONV_T2D(_zeros(*IMAGE), _zeros(4, 2, 3, 3)),
     fl.ShapeError, r"conv_transpose2d: input float32\[1, 3, 5, 5\] has 3 channels"),
    ("conv_transpose2d output_padding",
     lambda: CONV_T2D(_zeros(1, 4, 5, 5), _zeros(4, 2, 3, 3), output_padding=1),
     ValueError, r"output padding must be smaller than either stride or dilation"),
    ("linear features", lambda: convolution.linear(_zeros(2, 5), _zeros(3, 4)), fl.ShapeError,
     r"linear: input float32\[2, 5\] has 5 features"),
    ("fold blocks", lambda: folding.fold(_zeros(1, 12, 5), (4, 4), 2), fl.ShapeError,
     r"fold: expected size 5 of dim 2 .* 3 \* 3 = 9"),
    ("avg_pool2d padding", lambda: pooling.avg_pool2d(_zeros(1, 1, 5, 5), 2, padding=2),
     ValueError, r"avg_pool2d: pad should be non-negative and at most half"),
    ("max_pool2d rank", lambda: pooling.max_pool2d(_zeros(5, 5), 2), fl.ShapeError,
     r"max_pool2d: expected a 3-d \(unbatched\) or 4-d \(batched\) input, got input "
     r"float32\[5, 5\]"),
    ("pixel_shuffle channels", lambda: pooling.pixel_shuffle(_zeros(1, 5, 2, 2), 2),
     fl.ShapeError, r"pixel_shuffle: the channel dim of input float32\[1, 5, 2, 2\] \(5\)"),
    ("interpolate both", lambda: pooling.interpolate(_zeros(1, 1, 4, 4), 2, 2),
     ValueError, r"only one of size or scale_factor"),
    ("interpolate align nearest",
     lambda: pooling.interpolate(_zeros(1, 1, 4, 4), size=2, align_corners=True),
     ValueError, r"align_corners option can only be set"),
    ("interpolate size rank", lambda: pooling.interpolate(_zeros(1, 1, 4, 4), size=(2, 2, 2)),
     ValueError, r"has 2 spatial dims, but size is \[2, 2, 2\]"),
    ("interpolate mode rank",
     lambda: pooling.interpolate(_zeros(1, 1, 4, 4), size=2, mode="linear"),
     NotImplementedError, r"mode 'linear' needs a 3-d input"),
    ("attention dims", lambda: SDPA(_zeros(2, 3, 4), _zeros(2, 5, 3), _zeros(2, 5, 3)),
     fl.ShapeError,
     r"scaled_dot_product_attention: query float32\[2, 3, 4\] and key float32\[2, 5, 3\]"),
    ("attention causal and mask",
     lambda: SDPA(_zeros(2, 3, 4), _zeros(2, 3, 4), _zeros(2, 3, 4), _zeros(3, 3), is_causal=True),
     ValueError, r"attn_mask should not be set when is_causal"),
    ("attention gqa heads",
     lambda: SDPA(_zeros(1, 4, 3, 2), _zeros(1, 3, 3, 2), _zeros(1, 3, 3, 2), enable_gqa=True),
     fl.ShapeError, r"query heads .* must be a multiple of the key heads"),
    ("batch_norm stats",
     lambda: normalization.batch_norm(_zeros(2, 3, 4), _zeros(4), _zeros(4)), fl.ShapeError,
     r"batch_norm: running_mean must be \[3\] \(the channels of input float32\[2, 3, 4\]\)"),
    ("batch_norm one value",
     lambda: normalization.batch_norm(_zeros(1, 3), None, None, training=True),
     ValueError, r"batch_norm: expected more than 1 value per channel when training"),
]  # fmt: skip


@pytest.mark.parametrize("case", ERROR_CASES, ids=[case[0] for case in ERROR_CASES])
def test_bad_inputs_raise_at_build_time(case, reference_backend):
    _, build, error, message = case
    with pytest.raises(error, match=message):
        build()


def test_errors_name_the_user_line(reference_backend):
    with pytest.raises(fl.ShapeError) as caught:
        convolution.conv2d(fl.zeros(1, 3, 5, 5), fl.zeros(4, 2, 3, 3))
    assert "test_nn_functional_layers.py" in str(caught.value)


# --- against PyTorch: values and gradients -----------------------------------------------------


def _conv_grid():
    grid = itertools.product([1, 2], [0, 1, "same"], [1, 2], [1, 2, 4], [False, True])
    for stride, padding, dilation, groups, bias in grid:
        if padding == "same" and stride != 1:
            continue
        yield pytest.param(
            stride, padding, dilation, groups, bias,
            id=f"s{stride}-p{padding}-d{dilation}-g{groups}-{'bias' if bias else 'nobias'}",
        )  # fmt: skip


def _with_optional_bias(arrays, bias):
    return arrays if bias is not None else arrays[:-1]


@pytest.mark.parametrize("stride, padding, dilation, groups, bias", list(_conv_grid()))
def test_conv2d_matches_torch(stride, padding, dilation, groups, bias, rng):
    torch = torch_module()
    arrays = [_random(rng, 2, 4, 7, 6), _random(rng, 8, 4 // groups, 3, 2), _random(rng, 8)]
    arrays = arrays if bias else arrays[:2]

    def build(x, w, b=None):
        return convolution.conv2d(x, w, b, stride, padding, dilation, groups)

    def reference(x, w, b=None):
        return torch.nn.functional.conv2d(x, w, b, stride, padding, dilation, groups)

    check_against_torch(build, reference, arrays, list(range(len(arrays))), rng)


TRANSPOSED_GRID = [
    # (stride, padding, output_padding, dilation, groups, bias)
    (1, 0, 0, 1, 1, True), (2, 0, 1, 1, 1, False), (2, 1, 0, 1, 2, True),
    (2, 1, 1, 2, 2, True), (1, 1, 1, 2, 1, False), (3, 2, 2, 1, 4, True),
    ((2, 1), (1, 0), (1, 0), (1, 2), 2, True), (1, 2, 0, 1, 1, False),
]  # fmt: skip


@pytest.mark.parametrize("case", TRANSPOSED_GRID, ids=str)
def test_conv_transpose2d_matches_torch(case, rng):
    torch = torch_module()
    stride, padding, output_padding, dilation, groups, bias = case
    arrays = [_random(rng, 2, 4, 5, 6), _random(rng, 4, 8 // groups, 3, 2), _random(rng, 8)]
    arrays = arrays if bias else arrays[:2]
    arguments = (stride, padding, output_padding, groups, dilation)

    def build(x, w, b=None):
        return convolution.conv_transpose2d(x, w, b, *arguments)

    def reference(x, w, b=None):
        return torch.nn.functional.conv_transpose2d(x, w, b, *arguments)

    check_against_torch(build, reference, arrays, list(range(len(arrays))), rng)


@pytest.mark.parametrize(
    "case", [(1, 0, 1, 1), (2, 1, 2, 2), (1, "same", 2, 2), (3, 2, 1, 4)], ids=str
)
def test_conv1d_and_conv_transpose1d_match_torch(case, rng):
    torch = torch_module()
    stride, padding, dilation, groups = case
    arrays = [_random(rng, 2, 4, 11), _random(rng, 8, 4 // groups, 3), _random(rng, 8)]
    check_against_torch(
        lambda x, w, b: convolution.conv1d(x, w, b, stride, padding, dilation, groups),
        lambda x, w, b: torch.nn.functional.conv1d(x, w, b, stride, padding, dilation, groups),
        arrays, [0, 1, 2], rng,
    )  # fmt: skip
    if padding == "same":
        return
    extra = 1 if stride > 1 else 0
    arrays = [_random(rng, 2, 4, 6), _random(rng, 4, 8 // groups, 3), _random(rng, 8)]
    arguments = (stride, padding, extra, groups, dilation)
    check_against_torch(
        lambda x, w, b: convolution.conv_transpose1d(x, w, b, *arguments),
        lambda x, w, b: torch.nn.functional.conv_transpose1d(x, w, b, *arguments),
        arrays, [0, 1, 2], rng,
    )  # fmt: skip


def test_unbatched_convolutions_match_torch(rng):
    torch = torch_module()
    arrays = [_random(rng, 4, 7, 6), _random(rng, 6, 2, 3, 3)]
    check_against_torch(
        lambda x, w: convolution.conv2d(x, w, None, 2, 1, 1, 2),
        lambda x, w: torch.nn.functional.conv2d(x, w, None, 2, 1, 1, 2),
        arrays, [0, 1], rng,
    )  # fmt: skip
    arrays = [_random(rng, 4, 5, 6), _random(rng, 4, 3, 3, 3)]
    check_against_torch(
        lambda x, w: convolution.conv_transpose2d(x, w, None, 2, 1, 1),
        lambda x, w: torch.nn.functional.conv_transpose2d(x, w, None, 2, 1, 1),
        arrays, [0, 1], rng,
    )  # fmt: skip


def test_linear_and_bilinear_match_torch(rng):
    torch = torch_module()
    functional = torch.nn.functional
    arrays = [_random(rng, 3, 5, 4), _random(rng, 6, 4), _random(rng, 6)]
    check_against_torch(convolution.linear, functional.linear, arrays, [0, 1, 2], rng)
    arrays = [_random(rng, 3, 4), _random(rng, 4)]
    check_against_torch(convolution.linear, functional.linear, arrays, [0, 1], rng)
    arrays = [_random(rng, 2, 3, 4), _random(rng, 2, 3, 5), _random(rng, 6, 4, 5), _random(rng, 6)]
    check_against_torch(convolution.bilinear, functional.bilinear, arrays, [0, 1, 2, 3], rng)


@pytest.mark.parametrize(
    "kernel, dilation, padding, stride", [(2, 1, 0, 1), ((2, 3), 2, 1, (2, 1)), (3, 1, 1, 2)]
)
def test_unfold_and_fold_match_torch(kernel, dilation, padding, stride, rng):
    torch = torch_module()
    arguments = (kernel, dilation, padding, stride)
    check_against_torch(
        lambda x: folding.unfold(x, *arguments),
        lambda x: torch.nn.functional.unfold(x, *arguments),
        [_random(rng, 2, 3, 7, 8)], [0], rng,
    )  # fmt: skip
    columns = torch.nn.functional.unfold(torch.zeros(2, 3, 7, 8), *arguments)
    check_against_torch(
        lambda x: folding.fold(x, (7, 8), *arguments),
        lambda x: torch.nn.functional.fold(x, (7, 8), *arguments),
        [_random(rng, *columns.shape)], [0], rng,
    )  # fmt: skip


AVG_GRID = list(itertools.product([2, 3], [None, 1, 2], [0, 1], [False, True], [False, True]))


@pytest.mark.parametrize("kernel, stride, padding, ceil_mode, include_pad", AVG_GRID)
def test_avg_pool2d_matches_torch(kernel, stride, padding, ceil_mode, include_pad, rng):
    torch = torch_module()
    arguments = (kernel, stride, padding, ceil_mode, include_pad)
    check_against_torch(
        lambda x: pooling.avg_pool2d(x, *arguments),
        lambda x: torch.nn.functional.avg_pool2d(x, *arguments),
        [_random(rng, 2, 3, 7, 8)], [0], rng,
    )  # fmt: skip


MAX_GRID = list(itertools.product([2, 3], [None, 1, 2], [0, 1], [1, 2], [False, True]))


@pytest.mark.parametrize("kernel, stride, padding, dilation, ceil_mode", MAX_GRID)
def test_max_pool2d_matches_torch(kernel, stride, padding, dilation, ceil_mode, rng):
    torch = torch_module()
    arguments = (kernel, stride, padding, dilation, ceil_mode)
    arrays = [_random(rng, 2, 3, 7, 8)]
    check_against_torch(
        lambda x: pooling.max_pool2d(x, *arguments),
        lambda x: torch.nn.functional.max_pool2d(x, *arguments),
        arrays, [0], rng,
    )  # fmt: skip
    with fl.backend("reference"):
        _, indices = pooling.max_pool2d(fl.from_numpy(arrays[0]), *arguments, return_indices=True)
        indices = indices.numpy()
    _, expected = torch.nn.functional.max_pool2d(
        torch.from_numpy(arrays[0]), *arguments, return_indices=True
    )
    np.testing.assert_array_equal(indices, expected.numpy())


def test_pools_1d_and_options_match_torch(rng):
    torch = torch_module()
    functional = torch.nn.functional
    signal, image = [_random(rng, 2, 3, 11)], [_random(rng, 2, 3, 7, 8)]
    cases = [
        (lambda x: pooling.avg_pool1d(x, 3, 2, 1, True, False),
         lambda x: functional.avg_pool1d(x, 3, 2, 1, True, False), signal),
        (lambda x: pooling.max_pool1d(x, 3, 2, 1, 2, True),
         lambda x: functional.max_pool1d(x, 3, 2, 1, 2, True), signal),
        (lambda x: pooling.avg_pool2d(x, 3, 2, 1, divisor_override=4),
         lambda x: functional.avg_pool2d(x, 3, 2, 1, divisor_override=4), image),
        (lambda x: pooling.avg_pool2d(x[0], (2, 3), (1, 2)),
         lambda x: functional.avg_pool2d(x[0], (2, 3), (1, 2)), image),
        (lambda x: pooling.adaptive_avg_pool1d(x, 4),
         lambda x: functional.adaptive_avg_pool1d(x, 4), signal),
    ]  # fmt: skip
    for build, reference, arrays in cases:
        check_against_torch(build, reference, arrays, [0], rng)


@pytest.mark.parametrize("size", [1, 2, 3, (5, None), (3, 4), (7, 8), (4, 6), (9, 10)], ids=str)
def test_adaptive_pools_match_torch(size, rng):
    torch = torch_module()
    functional = torch.nn.functional
    arrays = [_random(rng, 2, 3, 7, 8)]
    check_against_torch(
        lambda x: pooling.adaptive_avg_pool2d(x, size),
        lambda x: functional.adaptive_avg_pool2d(x, size), arrays, [0], rng,
    )  # fmt: skip
    check_against_torch(
        lambda x: pooling.adaptive_max_pool2d(x, size),
        lambda x: functional.adaptive_max_pool2d(x, size), arrays, [0], rng,
    )  # fmt: skip


def test_pixel_shuffle_matches_torch(rng):
    torch = torch_module()
    functional = torch.nn.functional
    check_against_torch(
        lambda x: pooling.pixel_shuffle(x, 3),
        lambda x: functional.pixel_shuffle(x, 3), [_random(rng, 2, 2, 18, 4, 5)], [0], rng,
    )  # fmt: skip
    check_against_torch(
        lambda x: pooling.pixel_unshuffle(x, 2),
        lambda x: functional.pixel_unshuffle(x, 2), [_random(rng, 3, 6, 8)], [0], rng,
    )  # fmt: skip


RESIZES = [
    # (size, scale_factor, recompute_scale_factor)
    ((5, 11), None, None), (None, 2, None), (None, 1.7, None), (None, (0.5, 2.3), None),
    (None, 1.7, True), (14, None, None), (None, 0.3, None), ((3, 3), None, None),
]  # fmt: skip
INTERPOLATIONS = [
    pytest.param(
        mode, align, size, scale, recompute, id=f"{mode}-{align}-{size}-{scale}-{recompute}"
    )
    for mode, align in [("nearest", None), ("nearest-exact", None), ("bilinear", False),
                        ("bilinear", True), ("area", None)]
    for size, scale, recompute in RESIZES
]  # fmt: skip


@pytest.mark.parametrize("mode, align_corners, size, scale_factor, recompute", INTERPOLATIONS)
def test_interpolate_2d_matches_torch(mode, align_corners, size, scale_factor, recompute, rng):
    torch = torch_module()
    arguments = (size, scale_factor, mode, align_corners, recompute)
    check_against_torch(
        lambda x: pooling.interpolate(x, *arguments),
        lambda x: torch.nn.functional.interpolate(x, *arguments),
        [_random(rng, 2, 3, 7, 8)], [0], rng,
    )  # fmt: skip


@pytest.mark.parametrize(
    "shape, mode, align_corners, size, scale_factor",
    [
        ((2, 3, 9), "nearest", None, None, 1.5), ((2, 3, 9), "nearest-exact", None, 13, None),
        ((2, 3, 9), "linear", False, None, 1.5), ((2, 3, 9), "linear", True, 4, None),
        ((2, 3, 9), "area", None, 4, None), ((1, 2, 3, 4, 5), "trilinear", False, (4, 5, 7), None),
        ((1, 2, 3, 4, 5), "trilinear", True, None, 2),
        ((1, 2, 3, 4, 5), "nearest", None, None, 2.5),
    ],
)  # fmt: skip
def test_interpolate_1d_3d_match_torch(shape, mode, align_corners, size, scale_factor, rng):
    torch = torch_module()
    arguments = (size, scale_factor, mode, align_corners)
    check_against_torch(
        lambda x: pooling.interpolate(x, *arguments),
        lambda x: torch.nn.functional.interpolate(x, *arguments),
        [_random(rng, *shape)], [0], rng,
    )  # fmt: skip


def _attention_cases():
    keep = np.random.default_rng(3).random((2, 1, 5, 7)) > 0.3
    some_rows_empty = keep.copy()
    some_rows_empty[0, 0, 2] = False
    additive = np.random.default_rng(4).standard_normal((4, 1, 7)).astype(np.float32)
    return [
        ("plain", {}, None, (2, 4, 5, 8), (2, 4, 7, 8)),
        ("causal", {"is_causal": True}, None, (2, 4, 5, 8), (2, 4, 7, 8)),
        ("causal-long-query", {"is_causal": True}, None, (2, 4, 7, 8), (2, 4, 5, 8)),
        ("scale", {"scale": 0.3}, None, (2, 4, 5, 8), (2, 4, 7, 8)),
        ("bool-mask", {}, keep, (2, 4, 5, 8), (2, 4, 7, 8)),
        ("bool-mask-empty-row", {}, some_rows_empty, (2, 4, 5, 8), (2, 4, 7, 8)),
        ("additive-mask", {}, additive, (2, 4, 5, 8), (2, 4, 7, 8)),
        ("gqa", {"enable_gqa": True}, None, (2, 4, 5, 8), (2, 2, 7, 8)),
        ("3d", {}, None, (3, 5, 8), (3, 7, 8)),
    ]


@pytest.mark.parametrize("case", _attention_cases(), ids=lambda case: case[0])
def test_scaled_dot_product_attention_matches_torch(case, rng):
    torch = torch_module()
    _, keywords, mask, query_shape, key_shape = case
    arrays = [
        _random(rng, *query_shape),
        _random(rng, *key_shape),
        _random(rng, *key_shape[:-1], 6),
    ]
    if mask is not None:
        arrays.append(mask)

    def build(q, k, v, m=None):
        return attention.scaled_dot_product_attention(q, k, v, m, **keywords)

    def reference(q, k, v, m=None):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, m, **keywords)

    positions = [0, 1, 2] if mask is None or mask.dtype == bool else [0, 1, 2, 3]
    check_against_torch(build, reference, arrays, positions, rng)


MHA_CASES = [
    ("plain", {}), ("key-padding", {"key_padding_mask": "kpm"}),
    ("mask-no-weights", {"attn_mask": "float", "need_weights": False}),
    ("both-per-head",
     {"attn_mask": "bool", "key_padding_mask": "kpm", "average_attn_weights": False}),
    ("bias-kv", {"bias": True}), ("zero-attn", {"add_zero_attn": True, "key_padding_mask": "kpm"}),
]  # fmt: skip


@pytest.mark.parametrize("case", MHA_CASES, ids=lambda case: case[0])
def test_multi_head_attention_forward_matches_torch(case, rng):
    torch = torch_module()
    keywords = dict(case[1])
    target, source, batch, embed, heads = 5, 6, 3, 8, 2
    padding = rng.random((batch, source)) > 0.7
    padding[:, 0] = False
    masks = {
        "kpm": padding,
        "float": _random(rng, target, source),
        "bool": rng.random((target, source)) > 0.8,
    }
    bias = keywords.pop("bias", False)
    zero = keywords.pop("add_zero_attn", False)
    shapes = [(target, batch, embed), (source, batch, embed), (source, batch, embed),
              (3 * embed, embed), (3 * embed,), (embed, embed), (embed,), (1, 1, embed),
              (1, 1, embed)]  # fmt: skip
    arrays = [_random(rng, *shape) for shape in shapes]
    fixed = {name: masks[value] for name, value in keywords.items() if isinstance(value, str)}
    options = {name: value for name, value in keywords.items() if not isinstance(value, str)}

    def run(module, convert, q, k, v, w, b, ow, ob, bk, bv):
        extra = {name: convert(value) for name, value in fixed.items()}
        output, weights = module(
            q, k, v, embed, heads, w, b, bk if bias else None, bv if bias else None, zero, 0.0,
            ow, ob, **extra, **options,
        )  # fmt: skip
        return output if weights is None else (output, weights)

    positions = [0, 1, 2, 3, 4, 5, 6] + ([7, 8] if bias else [])
    weight_positions = [0, 1, 3, 4] + ([7] if bias else [])  # what the weights depend on
    ours, theirs = (
        multihead_attention.multi_head_attention_forward,
        torch.nn.functional.multi_head_attention_forward,
    )
    for pick in (0, 1):  # the output, then the attention weights (where returned)
        if pick and options.get("need_weights") is False:
            continue
        check_against_torch(
            lambda *values, pick=pick: _pick(run(ours, fl.from_numpy, *values), pick),
            lambda *values, pick=pick: _pick(run(theirs, torch.from_numpy, *values), pick),
            arrays, weight_positions if pick else positions, rng,
            atol=1e-4,  # the key biases' gradients are 0 up to rounding
        )  # fmt: skip


def _pick(result, index):
    return result[index] if isinstance(result, tuple) else result


@pytest.mark.parametrize("shape", [(4, 3), (4, 3, 5), (2, 3, 4, 5)], ids=str)
def test_batch_norm_matches_torch(shape, rng):
    torch = torch_module()
    functional = torch.nn.functional
    arrays = [_random(rng, *shape) * 2 + 1, _random(rng, 3), _random(rng, 3)]
    check_against_torch(
        lambda x, w, b: normalization.batch_norm(x, None, None, w, b, training=True),
        lambda x, w, b: functional.batch_norm(x, None, None, w, b, training=True),
        arrays, [0, 1, 2], rng,
    )  # fmt: skip
    stats = [np.abs(_random(rng, 3)), np.abs(_random(rng, 3)) + 0.5]
    check_against_torch(
        lambda x, w, b, m, v: normalization.batch_norm(x, m, v, w, b, eps=1e-3),
        lambda x, w, b, m, v: functional.batch_norm(x, m, v, w, b, eps=1e-3),
        arrays + stats, [0, 1, 2], rng,
    )  # fmt: skip
    with fl.backend("reference"):
        mean, var = fl.zeros(3), fl.ones(3)
        expected_mean, expected_var = torch.zeros(3), torch.ones(3)
        for step in range(3):
            batch = _random(rng, *shape) * (step + 1) + step
            normalization.batch_norm(fl.from_numpy(batch), mean, var, training=True, momentum=0.3)
            functional.batch_norm(
                torch.from_numpy(batch), expected_mean, expected_var, training=True, momentum=0.3
            )
        np.testing.assert_allclose(mean.numpy(), expected_mean.numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(var.numpy(), expected_var.numpy(), rtol=1e-5, atol=1e-6)


def test_instance_norm_matches_torch(rng):
    torch = torch_module()
    functional = torch.nn.functional
    arrays = [_random(rng, 2, 3, 4, 5), _random(rng, 3), _random(rng, 3)]
    check_against_torch(
        lambda x, w, b: normalization.instance_norm(x, weight=w, bias=b),
        lambda x, w, b: functional.instance_norm(x, weight=w, bias=b),
        arrays, [0, 1, 2], rng,
    )  # fmt: skip
    with fl.backend("reference"):
        mean, var = fl.zeros(3), fl.ones(3)
        expected_mean, expected_var = torch.zeros(3), torch.ones(3)
        for step in range(3):
            batch = _random(rng, 2, 3, 6) * (step + 1) + step
            result = normalization.instance_norm(fl.from_numpy(batch), mean, var, momentum=0.3)
            expected = functional.instance_norm(
                torch.from_numpy(batch), expected_mean, expected_var, momentum=0.3
            )
            np.testing.assert_allclose(result.numpy(), expected.numpy(), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(mean.numpy(), expected_mean.numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(var.numpy(), expected_var.numpy(), rtol=1e-5, atol=1e-6)
        evaluated = normalization.instance_norm(
            fl.from_numpy(batch), mean, var, use_input_stats=False
        )
        expected = functional.instance_norm(
            torch.from_numpy(batch), expected_mean, expected_var, use_input_stats=False
        )
        np.testing.assert_allclose(evaluated.numpy(), expected.numpy(), rtol=1e-4, atol=1e-5)


# --- GPU tier: the cuda backend against the reference backend ------------------------------------


INTERPOLATE, BATCH_NORM = pooling.interpolate, normalization.batch_norm
SAMPLES, IMAGES, HEADS = [(2, 4, 9, 8), (6, 2, 3, 3), (6,)], [(2, 3, 9, 8)], (2, 4, 5, 8)
GPU_CASES = [
    ("conv2d", lambda x, w, b: CONV2D(x, w, b, 2, 1, 1, 2), SAMPLES),
    ("conv2d-same-dilated", lambda x, w, b: CONV2D(x, w, b, 1, "same", 2),
     [(2, 4, 9, 8), (6, 4, 3, 2), (6,)]),
    ("conv1d", lambda x, w, b: convolution.conv1d(x, w, b, 2, 1), [(2, 4, 11), (6, 4, 3), (6,)]),
    ("conv_transpose2d", lambda x, w, b: CONV_T2D(x, w, b, 2, 1, 1, 2),
     [(2, 4, 5, 6), (4, 3, 3, 3), (6,)]),
    ("linear", convolution.linear, [(3, 5, 4), (6, 4), (6,)]),
    ("fold-unfold",
     lambda x: folding.fold(folding.unfold(x, 3, 1, 1, 2), (7, 8), 3, 1, 1, 2),
     [(2, 3, 7, 8)]),
    ("avg_pool2d", lambda x: pooling.avg_pool2d(x, 3, 2, 1, True, False), IMAGES),
    ("max_pool2d", lambda x: pooling.max_pool2d(x, 3, 2, 1, 1, True), IMAGES),
    ("adaptive_avg_pool2d", lambda x: pooling.adaptive_avg_pool2d(x, (4, 3)), IMAGES),
    ("adaptive_max_pool2d", lambda x: pooling.adaptive_max_pool2d(x, (4, 3)), IMAGES),
    ("pixel_shuffle", lambda x: pooling.pixel_shuffle(x, 2), [(2, 8, 3, 4)]),
    ("interpolate-nearest", lambda x: INTERPOLATE(x, scale_factor=1.7), IMAGES),
    ("interpolate-bilinear", lambda x: INTERPOLATE(x, (7, 11), mode="bilinear"), IMAGES),
    ("attention-causal", lambda q, k, v: SDPA(q, k, v, is_causal=True),
     [HEADS, (2, 4, 7, 8), (2, 4, 7, 8)]),
    ("attention-gqa", lambda q, k, v: SDPA(q, k, v, enable_gqa=True),
     [HEADS, (2, 2, 7, 8), (2, 2, 7, 8)]),
    ("batch_norm", lambda x, w, b: BATCH_NORM(x, None, None, w, b, True),
     [(4, 3, 5, 6), (3,), (3,)]),
    ("instance_norm", lambda x, w, b: normalization.instance_norm(x, weight=w, bias=b),
     [(4, 3, 5, 6), (3,), (3,)]),
]  # fmt: skip


def _value_and_gradients(build, arrays, projection, backend_name):
    with fl.backend(backend_name):
        tensors = [fl.from_numpy(array) for array in arrays]
        out, pullback = fl.vjp(build, *tensors)
        cotangents = pullback(fl.from_numpy(projection))
        return out.numpy(), [cotangent.numpy() for cotangent in cotangents]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda case: case[0])
def test_gpu_matches_reference(case, rng):
    _, build, shapes = case
    arrays = [_random(rng, *shape) for shape in shapes]
    with fl.backend("reference"):
        out_shape = build(*[fl.from_numpy(array) for array in arrays]).shape
    projection = _random(rng, *out_shape)
    expected, expected_grads = _value_and_gradients(build, arrays, projection, "reference")
    with fl.matmul_precision("highest"):
        value, grads = _value_and_gradients(build, arrays, projection, "cuda")
    np.testing.assert_allclose(value, expected, rtol=1e-4, atol=1e-4)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        np.testing.assert_allclose(grad, expected_grad, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_gpu_batch_norm_running_statistics(rng):
    batches = [_random(rng, 4, 3, 2, 5) * (step + 1) for step in range(3)]
    results = {}
    for backend_name in ("reference", "cuda"):
        with fl.backend(backend_name):
            mean, var = fl.zeros(3), fl.ones(3)
            for batch in batches:
                normalization.batch_norm(fl.from_numpy(batch), mean, var, training=True).numpy()
            results[backend_name] = (mean.numpy(), var.numpy())
    for got, expected in zip(results["cuda"], results["reference"], strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
