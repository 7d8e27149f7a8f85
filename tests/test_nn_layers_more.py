"""Layer modules against PyTorch's (issue 19): activations, dropout, flatten, pooling, pixel
shuffle, upsampling and ``MultiheadAttention``. Each module's forward value and input
gradient (and parameter gradients) against ``torch.nn``'s, its ``repr`` and ``state_dict``
keys, its argument checks; dropout's masks by their statistics and seeds. The ``backend``
fixture runs the value tests once on the reference backend and once on the GPU (gpu tier)."""

from __future__ import annotations

import numpy as np
import pytest

import flame as fl
from flame.nn.modules import (
    activation,
    attention,
    dropout,
    flatten,
    pixelshuffle,
    pooling,
    upsampling,
)

# the modules by name, as flame.nn will export them
L = {
    name: getattr(module, name)
    for module in (activation, attention, dropout, flatten, pixelshuffle, pooling, upsampling)
    for name in module.__all__
    if name[0].isupper()
}


def _grad_check(torch, ours, theirs, x: np.ndarray, rng, tol: float = 1e-5):
    """Forward value and the input's gradient of a random linear functional of the output."""
    xf = fl.tensor(x).requires_grad_()
    xt = torch.from_numpy(x.copy()).requires_grad_()
    out_f, out_t = ours(xf), theirs(xt)
    if isinstance(out_t, tuple):  # (values, indices): compare both, differentiate values
        np.testing.assert_array_equal(out_f[1].numpy(), out_t[1].numpy())
        out_f, out_t = out_f[0], out_t[0]
    np.testing.assert_allclose(out_f.numpy(), out_t.detach().numpy(), rtol=tol, atol=tol)
    weight = rng.standard_normal(out_t.shape).astype(x.dtype)
    (out_f * fl.tensor(weight)).sum().backward()
    (out_t * torch.from_numpy(weight)).sum().backward()
    np.testing.assert_allclose(xf.grad.numpy(), xt.grad.numpy(), rtol=tol, atol=tol)
    return xf


# --- elementwise and row-wise modules ----------------------------------------------------------

# (name, args, kwargs, input shape)
SIMPLE = [
    ("ReLU", (), {}, (3, 5)),
    ("ReLU6", (), {}, (3, 5)),
    ("SiLU", (), {}, (3, 5)),
    ("GELU", (), {}, (3, 5)),
    ("GELU", (), {"approximate": "tanh"}, (3, 5)),
    ("Tanh", (), {}, (3, 5)),
    ("Sigmoid", (), {}, (3, 5)),
    ("Mish", (), {}, (3, 5)),
    ("LeakyReLU", (), {}, (3, 5)),
    ("LeakyReLU", (0.2,), {}, (3, 5)),
    ("Softplus", (), {}, (3, 5)),
    ("Softplus", (), {"beta": 2.0, "threshold": 1.0}, (3, 5)),
    ("ELU", (0.7,), {}, (3, 5)),
    ("CELU", (0.7,), {}, (3, 5)),
    ("SELU", (), {}, (3, 5)),
    ("Hardswish", (), {}, (3, 5)),
    ("Hardsigmoid", (), {}, (3, 5)),
    ("Hardtanh", (-0.5, 0.8), {}, (3, 5)),
    ("Threshold", (0.1, -2.0), {}, (3, 5)),
    ("Hardshrink", (0.3,), {}, (3, 5)),
    ("Softshrink", (0.3,), {}, (3, 5)),
    ("Softsign", (), {}, (3, 5)),
    ("Tanhshrink", (), {}, (3, 5)),
    ("LogSigmoid", (), {}, (3, 5)),
    ("GLU", (), {}, (3, 6)),
    ("GLU", (0,), {}, (4, 3)),
    ("Softmax", (1,), {}, (3, 5)),
    ("Softmax", (), {"dim": 0}, (3, 5)),
    ("LogSoftmax", (-1,), {}, (3, 5)),
    ("Softmin", (1,), {}, (3, 5)),
    ("Softmax2d", (), {}, (2, 3, 4, 5)),
    ("Flatten", (), {}, (2, 3, 4, 5)),
    ("Flatten", (0, 2), {}, (2, 3, 4, 5)),
    ("Unflatten", (1, (2, 6)), {}, (3, 12)),
    ("Unflatten", (-1, [3, -1]), {}, (2, 3, 12)),
    ("MaxPool2d", (2,), {}, (2, 3, 8, 8)),
    ("MaxPool2d", (3, 2, 1), {"ceil_mode": True}, (2, 3, 9, 7)),
    ("MaxPool2d", ((3, 2),), {"stride": (2, 1), "dilation": (1, 2)}, (1, 2, 9, 9)),
    ("MaxPool2d", (2,), {"return_indices": True}, (2, 3, 6, 6)),
    ("MaxPool1d", (3, 2, 1), {}, (2, 3, 9)),
    ("AvgPool2d", (2,), {}, (2, 3, 8, 8)),
    ("AvgPool2d", (3, 2, 1), {"count_include_pad": False, "ceil_mode": True}, (2, 3, 9, 7)),
    ("AvgPool2d", (2,), {"divisor_override": 3}, (2, 3, 6, 6)),
    ("AvgPool1d", (3,), {"stride": 2, "padding": 1}, (2, 3, 9)),
    ("AdaptiveAvgPool2d", ((3, 5),), {}, (2, 3, 8, 9)),
    ("AdaptiveAvgPool2d", (1,), {}, (2, 3, 7, 7)),
    ("AdaptiveAvgPool2d", ((None, 2),), {}, (2, 3, 5, 7)),
    ("AdaptiveAvgPool1d", (4,), {}, (2, 3, 10)),
    ("AdaptiveMaxPool2d", ((2, 3),), {}, (2, 3, 7, 8)),
    ("PixelShuffle", (2,), {}, (2, 8, 3, 4)),
    ("PixelUnshuffle", (2,), {}, (2, 3, 6, 4)),
    ("Upsample", (), {"scale_factor": 2}, (2, 3, 4, 5)),
    ("Upsample", (), {"size": (7, 9), "mode": "nearest"}, (2, 3, 4, 5)),
    ("Upsample", (), {"scale_factor": 1.5, "mode": "bilinear"}, (2, 3, 4, 5)),
    ("Upsample", (), {"size": 7, "mode": "bilinear", "align_corners": True}, (2, 3, 4, 5)),
    ("Upsample", (), {"scale_factor": (2, 3), "mode": "nearest-exact"}, (1, 2, 4, 5)),
    ("UpsamplingNearest2d", (), {"scale_factor": 2}, (2, 3, 4, 5)),
    ("UpsamplingBilinear2d", (), {"size": (6, 8)}, (2, 3, 4, 5)),
    ("Dropout", (0.3,), {}, (3, 5)),  # eval mode: the identity
    ("Dropout2d", (), {}, (2, 3, 4, 5)),
]


def _case_id(case) -> str:
    name, args, kwargs, _ = case
    extra = ",".join([repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()])
    return f"{name}({extra})"


@pytest.mark.parametrize("case", SIMPLE, ids=_case_id)
def test_module_matches_pytorch(case, backend, rng):
    torch = pytest.importorskip("torch")
    name, args, kwargs, shape = case
    ours, theirs = L[name](*args, **kwargs).eval(), getattr(torch.nn, name)(*args, **kwargs).eval()
    assert repr(ours) == repr(theirs)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    x = (rng.standard_normal(shape) * 2).astype(np.float32)
    _grad_check(torch, ours, theirs, x, rng)


@pytest.mark.parametrize(
    "name, args",
    [
        ("ReLU", ()), ("ReLU6", ()), ("SiLU", ()), ("Mish", ()), ("SELU", ()), ("ELU", (0.5,)),
        ("CELU", (2.0,)), ("LeakyReLU", (0.1,)), ("Hardswish", ()), ("Hardsigmoid", ()),
        ("Hardtanh", (-2.0, 2.0)), ("Threshold", (0.5, 1.0)), ("Dropout", (0.5,)),
        ("Dropout1d", (0.25,)), ("Dropout2d", ()), ("Dropout3d", (0.1,)),
    ],
)  # fmt: skip
def test_inplace_flag_repr_and_write(name, args, reference_backend, rng):
    """``inplace=True`` shows in ``repr`` as PyTorch's does and writes the input."""
    torch = pytest.importorskip("torch")
    ours = L[name](*args, inplace=True)
    assert repr(ours) == repr(getattr(torch.nn, name)(*args, inplace=True))
    if name.startswith("Dropout"):
        return
    x = rng.standard_normal((3, 4)).astype(np.float32)
    xf = fl.tensor(x)
    result = ours(xf)
    expected = getattr(torch.nn, name)(*args)(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(xf.numpy(), expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(result.numpy(), expected, rtol=1e-6, atol=1e-6)


def test_repr_of_default_and_unusual_arguments(reference_backend):
    torch = pytest.importorskip("torch")
    cases = [
        ("GELU", (), {}), ("Dropout", (), {}), ("Dropout", (0.1, True), {}),
        ("MaxPool2d", (2,), {}), ("MaxPool2d", ((3, 2), None, 1), {"ceil_mode": True}),
        ("AvgPool2d", (3,), {"stride": 1, "padding": 1}), ("AvgPool1d", (3,), {}),
        ("AdaptiveAvgPool2d", ((7, 7),), {}), ("AdaptiveAvgPool1d", (4,), {}),
        ("Upsample", (), {"scale_factor": 2}), ("Upsample", (), {"size": (4, 5)}),
        ("Upsample", (), {"scale_factor": (2, 3), "mode": "bilinear"}),
        ("Flatten", (), {}), ("Unflatten", (1, (2, 3)), {}), ("Softmax", (), {}),
        ("LogSoftmax", (1,), {}), ("Softplus", (), {}), ("LeakyReLU", (), {}),
        ("PixelShuffle", (3,), {}), ("PixelUnshuffle", (2,), {}), ("PReLU", (), {}),
        ("PReLU", (3, 0.1), {}), ("Hardshrink", (), {}), ("Softshrink", (0.2,), {}),
        ("GLU", (), {}), ("ELU", (), {}), ("Threshold", (0.1, 20), {}), ("ReLU6", (), {}),
        ("Hardtanh", (), {}), ("MultiheadAttention", (8, 2), {}),
        ("MultiheadAttention", (8, 4), {"kdim": 3, "vdim": 5, "bias": False}),
    ]  # fmt: skip
    for name, args, kwargs in cases:
        assert repr(L[name](*args, **kwargs)) == repr(getattr(torch.nn, name)(*args, **kwargs))


def test_attributes_are_pytorchs(reference_backend):
    torch = pytest.importorskip("torch")
    for name, args, kwargs, attributes in [
        ("MaxPool2d", (3,), {}, ("kernel_size", "stride", "padding", "dilation", "ceil_mode")),
        ("AvgPool1d", (3,), {"padding": 1}, ("kernel_size", "stride", "padding")),
        ("AvgPool2d", (3, 1), {}, ("kernel_size", "stride", "padding", "divisor_override")),
        ("Upsample", (), {"scale_factor": 2}, ("size", "scale_factor", "mode", "align_corners")),
        ("UpsamplingBilinear2d", (), {"size": 3}, ("size", "mode", "align_corners")),
        ("Softmax", (), {}, ("dim",)),
        ("MultiheadAttention", (8, 2), {}, ("embed_dim", "kdim", "vdim", "num_heads",
                                            "head_dim", "dropout", "batch_first",
                                            "_qkv_same_embed_dim", "bias_k", "add_zero_attn")),
    ]:  # fmt: skip
        ours, theirs = L[name](*args, **kwargs), getattr(torch.nn, name)(*args, **kwargs)
        for attribute in attributes:
            assert getattr(ours, attribute) == getattr(theirs, attribute), (name, attribute)


def test_prelu_matches_pytorch_with_its_weight_gradient(reference_backend, rng):
    torch = pytest.importorskip("torch")
    for count in (1, 3):
        ours, theirs = L["PReLU"](count, 0.3), torch.nn.PReLU(count, 0.3)
        assert list(ours.state_dict()) == ["weight"] and ours.weight.shape == (count,)
        x = rng.standard_normal((2, 3, 4)).astype(np.float32)
        _grad_check(torch, ours, theirs, x, rng)
        np.testing.assert_allclose(
            ours.weight.grad.numpy(), theirs.weight.grad.numpy(), rtol=1e-5, atol=1e-5
        )


def test_softmax_without_dim_warns_and_picks_pytorchs_dim(reference_backend, rng):
    torch = pytest.importorskip("torch")
    for shape in [(5,), (3, 4), (2, 3, 4), (2, 3, 4, 5)]:
        x = rng.standard_normal(shape).astype(np.float32)
        with pytest.warns(UserWarning, match="Implicit dimension choice for softmax"):
            ours = L["Softmax"]()(fl.tensor(x)).numpy()
        with pytest.warns(UserWarning):
            theirs = torch.nn.Softmax()(torch.from_numpy(x)).numpy()
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6)


def test_argument_errors_are_pytorchs(reference_backend):
    with pytest.raises(ValueError, match="dropout probability has to be between 0 and 1, but got"):
        L["Dropout"](1.5)
    with pytest.raises(ValueError, match="between 0 and 1"):
        L["Dropout2d"](-0.1)
    with pytest.raises(AssertionError, match=r"max_val \(1.0\) must be greater than min_val"):
        L["Hardtanh"](2.0, 1.0)
    with pytest.raises(TypeError, match="unflattened_size must be tuple of ints"):
        L["Unflatten"](1, (2, 3.0))
    with pytest.raises(TypeError, match="unflattened_size must be a tuple of ints"):
        L["Unflatten"](1, 6)
    with pytest.raises(AssertionError, match="embed_dim must be divisible by num_heads"):
        L["MultiheadAttention"](10, 3)
    with pytest.raises(ValueError, match="embed_dim and num_heads must be greater than 0"):
        L["MultiheadAttention"](0, 1)
    with pytest.raises(ValueError, match="Softmax2d: expected input to be 3D or 4D"):
        L["Softmax2d"]()(fl.zeros(3, 4))
    with pytest.raises(RuntimeError, match="Halving dimension must be even"):
        L["GLU"]()(fl.zeros(3, 5))


# --- dropout -----------------------------------------------------------------------------------


def test_dropout_is_identity_in_eval_and_for_p_zero(reference_backend, rng):
    for name, shape in [("Dropout", (4, 6)), ("Dropout1d", (4, 6)), ("Dropout2d", (2, 4, 3, 3)),
                        ("Dropout3d", (2, 4, 3, 3, 2))]:  # fmt: skip
        x = fl.tensor(rng.standard_normal(shape).astype(np.float32))
        assert L[name](0.5).eval()(x) is x
        assert L[name](0.0)(x) is x


def test_dropout_zeros_about_p_and_scales_the_rest(reference_backend):
    p = 0.3
    x = fl.ones(200, 500)
    fl.manual_seed(7)
    out = L["Dropout"](p)(x).numpy()
    kept = out != 0
    assert abs(1.0 - kept.mean() - p) < 0.01
    np.testing.assert_allclose(out[kept], 1.0 / (1.0 - p), rtol=1e-6)
    assert np.all(L["Dropout"](1.0)(x).numpy() == 0)


def test_dropout_same_seed_same_mask_and_the_gradient_follows_it(reference_backend):
    layer = L["Dropout"](0.5)
    x = fl.ones(64, 64).requires_grad_()
    fl.manual_seed(3)
    first = layer(x)
    first.sum().backward()
    fl.manual_seed(3)
    second = layer(x).numpy()
    third = layer(x).numpy()  # the generator moved on: another mask
    np.testing.assert_array_equal(first.numpy(), second)
    assert not np.array_equal(second, third)
    np.testing.assert_array_equal(x.grad.numpy(), second)  # d(mask * 2x)/dx = mask * 2


@pytest.mark.parametrize("name, shape", [("Dropout1d", (8, 16, 5)), ("Dropout1d", (16, 5)),
                                         ("Dropout2d", (8, 16, 3, 4)),
                                         ("Dropout3d", (4, 16, 2, 3, 2)),
                                         ("Dropout3d", (16, 2, 3, 2))])  # fmt: skip
def test_channel_dropout_zeros_whole_channels(name, shape, reference_backend):
    fl.manual_seed(11)
    out = L[name](0.5)(fl.ones(*shape)).numpy()
    spatial = int(name[-2])  # Dropout1d: one spatial dim, ...
    planes = out.reshape(-1, int(np.prod(shape[-spatial:])))
    assert np.all((planes == 0).all(axis=1) | (planes == 2.0).all(axis=1))
    assert 0 < (planes == 0).all(axis=1).sum() < planes.shape[0]


def test_dropout1d_rejects_other_ranks(reference_backend):
    with pytest.raises(RuntimeError, match="dropout1d: Expected 2D or 3D input"):
        L["Dropout1d"]()(fl.ones(2, 3, 4, 5))


# --- MultiheadAttention ------------------------------------------------------------------------


def _copy_weights(torch, theirs, ours, tmp_path) -> None:
    """PyTorch's weights into ours through a safetensors file."""
    from safetensors.numpy import load_file
    from safetensors.torch import save_file

    path = str(tmp_path / "mha.safetensors")
    save_file({key: value.contiguous() for key, value in theirs.state_dict().items()}, path)
    arrays = load_file(path)
    ours.load_state_dict({key: fl.tensor(value) for key, value in arrays.items()})


def _mha_pair(torch, tmp_path, *args, **kwargs):
    torch.manual_seed(0)
    theirs = torch.nn.MultiheadAttention(*args, **kwargs)
    ours = L["MultiheadAttention"](*args, **kwargs)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    for key, value in theirs.state_dict().items():
        assert ours.state_dict()[key].shape == tuple(value.shape), key
    _copy_weights(torch, theirs, ours, tmp_path)
    return ours, theirs


def _bool_mask(rng, shape, keep_first: bool = True) -> np.ndarray:
    mask = rng.random(shape) < 0.35
    if keep_first:  # no row masked entirely (PyTorch gives NaN there)
        mask[..., 0] = False
    return mask


def _masks(kind: str, rng, batch: int, heads: int, target: int, source: int):
    """(key_padding_mask, attn_mask, is_causal) as NumPy arrays."""
    causal = np.triu(np.ones((target, source), dtype=bool), 1)
    return {
        "none": (None, None, False),
        "padding": (_bool_mask(rng, (batch, source)), None, False),
        "bool2d": (None, _bool_mask(rng, (target, source)), False),
        "float3d": (None, rng.standard_normal((batch * heads, target, source)).astype(np.float32),
                    False),
        "both": (_bool_mask(rng, (batch, source)), _bool_mask(rng, (target, source)), False),
        "float_padding": (np.where(_bool_mask(rng, (batch, source)), -np.inf, 0.0)
                          .astype(np.float32), None, False),
        "causal": (None, causal, True),
        "causal_padding": (_bool_mask(rng, (batch, source)), causal, True),
    }[kind]  # fmt: skip


def _mha_check(torch, ours, theirs, inputs, rng, tol=2e-5, **call):
    """Run both on the same inputs ([q, k, v] arrays, q may be k may be v), compare outputs,
    weights and every gradient."""
    unique = {id(a): a for a in inputs}
    flame_in = {key: fl.tensor(a).requires_grad_() for key, a in unique.items()}
    torch_in = {key: torch.from_numpy(a.copy()).requires_grad_() for key, a in unique.items()}
    masks_f = {k: (fl.tensor(v) if v is not None else None) for k, v in call.pop("masks").items()}
    masks_t = {k: (None if v is None else torch.from_numpy(v.numpy())) for k, v in masks_f.items()}
    out_f, w_f = ours(*(flame_in[id(a)] for a in inputs), **masks_f, **call)
    out_t, w_t = theirs(*(torch_in[id(a)] for a in inputs), **masks_t, **call)
    np.testing.assert_allclose(out_f.numpy(), out_t.detach().numpy(), rtol=tol, atol=tol)
    if w_t is None:
        assert w_f is None
    else:
        np.testing.assert_allclose(w_f.numpy(), w_t.detach().numpy(), rtol=tol, atol=tol)
    grad = rng.standard_normal(out_t.shape).astype(np.float32)
    loss_f = (out_f * fl.tensor(grad)).sum()
    loss_t = (out_t * torch.from_numpy(grad)).sum()
    if w_t is not None:
        loss_f, loss_t = loss_f + (w_f * w_f).sum(), loss_t + (w_t * w_t).sum()
    loss_f.backward()
    loss_t.backward()
    for key in unique:
        np.testing.assert_allclose(
            flame_in[key].grad.numpy(), torch_in[key].grad.numpy(), rtol=tol, atol=tol
        )
    theirs_params = dict(theirs.named_parameters())
    for name, param in ours.named_parameters():
        np.testing.assert_allclose(
            param.grad.numpy(), theirs_params[name].grad.numpy(), rtol=tol, atol=tol, err_msg=name
        )


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("need_weights, average", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize(
    "masks", ["none", "padding", "bool2d", "float3d", "both", "float_padding", "causal",
              "causal_padding"]
)  # fmt: skip
def test_multihead_self_attention_matches_pytorch(
    batch_first, need_weights, average, masks, reference_backend, rng, tmp_path
):
    torch = pytest.importorskip("torch")
    embed, heads, batch, length = 12, 3, 2, 5
    ours, theirs = _mha_pair(torch, tmp_path, embed, heads, batch_first=batch_first)
    shape = (batch, length, embed) if batch_first else (length, batch, embed)
    x = rng.standard_normal(shape).astype(np.float32)
    padding, attn_mask, causal = _masks(masks, rng, batch, heads, length, length)
    _mha_check(
        torch, ours, theirs, [x, x, x], rng, need_weights=need_weights,
        average_attn_weights=average, is_causal=causal,
        masks={"key_padding_mask": padding, "attn_mask": attn_mask},
    )  # fmt: skip


@pytest.mark.parametrize(
    "kwargs, same",
    [
        ({}, "kv"),  # encoder-decoder: key is value
        ({}, ""),
        ({"kdim": 5, "vdim": 7}, ""),
        ({"bias": False}, "qkv"),
        ({"add_bias_kv": True}, ""),
        ({"add_zero_attn": True}, "qkv"),
        ({"add_bias_kv": True, "add_zero_attn": True, "kdim": 6, "vdim": 6}, ""),
        ({"dropout": 0.5}, "qkv"),  # eval mode: no dropout
    ],
)
@pytest.mark.parametrize("need_weights", [True, False])
def test_multihead_cross_attention_variants_match_pytorch(
    kwargs, same, need_weights, reference_backend, rng, tmp_path
):
    torch = pytest.importorskip("torch")
    embed, heads, batch, target, source = 8, 2, 3, 4, 6
    ours, theirs = _mha_pair(torch, tmp_path, embed, heads, batch_first=True, **kwargs)
    ours.eval(), theirs.eval()
    query = rng.standard_normal((batch, target, embed)).astype(np.float32)
    key = rng.standard_normal((batch, source, kwargs.get("kdim", embed))).astype(np.float32)
    value = rng.standard_normal((batch, source, kwargs.get("vdim", embed))).astype(np.float32)
    if same == "qkv":
        key = value = query
        source = target
    elif same == "kv":
        value = key
    padding, attn_mask, _ = _masks("both", rng, batch, heads, target, source)
    _mha_check(
        torch, ours, theirs, [query, key, value], rng, need_weights=need_weights,
        masks={"key_padding_mask": padding, "attn_mask": attn_mask},
    )  # fmt: skip


@pytest.mark.parametrize("need_weights", [True, False])
def test_multihead_attention_unbatched_matches_pytorch(need_weights, reference_backend, rng,
                                                        tmp_path):  # fmt: skip
    torch = pytest.importorskip("torch")
    ours, theirs = _mha_pair(torch, tmp_path, 8, 4)
    x = rng.standard_normal((5, 8)).astype(np.float32)
    attn = rng.standard_normal((4, 5, 5)).astype(np.float32)  # 3-d: one mask per head
    with pytest.warns(UserWarning, match="Support for mismatched key_padding_mask and attn_mask"):
        _mha_check(
            torch, ours, theirs, [x, x, x], rng, need_weights=need_weights,
            average_attn_weights=False,
            masks={"key_padding_mask": _bool_mask(rng, (5,)), "attn_mask": attn},
        )  # fmt: skip


def test_multihead_attention_initialisation_is_pytorchs(reference_backend):
    """xavier_uniform_ projections (bound sqrt(6 / (E + 3E))), zero biases, out_proj as
    Linear's default, bias_k/bias_v normal."""
    torch = pytest.importorskip("torch")
    fl.manual_seed(0)
    ours = L["MultiheadAttention"](64, 4, add_bias_kv=True)
    weight = ours.in_proj_weight.numpy()
    bound = np.sqrt(6.0 / (64 + 3 * 64))
    assert np.abs(weight).max() <= bound and np.abs(weight).max() > 0.95 * bound
    assert np.all(ours.in_proj_bias.numpy() == 0) and np.all(ours.out_proj.bias.numpy() == 0)
    assert np.abs(ours.out_proj.weight.numpy()).max() <= 1 / 8
    assert ours.bias_k.shape == (1, 1, 64) and np.std(ours.bias_k.numpy()) > 0
    theirs = torch.nn.MultiheadAttention(64, 4, add_bias_kv=True)
    assert [(n, tuple(p.shape)) for n, p in ours.named_parameters()] == [
        (n, tuple(p.shape)) for n, p in theirs.named_parameters()
    ]
    separate = L["MultiheadAttention"](8, 2, kdim=3, vdim=5)
    assert separate.in_proj_weight is None
    assert [(n, p.shape) for n, p in separate.named_parameters()] == [
        ("q_proj_weight", (8, 8)), ("k_proj_weight", (8, 3)), ("v_proj_weight", (8, 5)),
        ("in_proj_bias", (24,)), ("out_proj.weight", (8, 8)), ("out_proj.bias", (8,)),
    ]  # fmt: skip


def test_multihead_attention_errors_are_pytorchs(reference_backend):
    layer = L["MultiheadAttention"](8, 2)
    x = fl.zeros(4, 2, 8)
    with pytest.raises(RuntimeError, match="Need attn_mask if specifying the is_causal hint"):
        layer(x, x, x, is_causal=True)
    with pytest.raises(RuntimeError, match="The shape of the 2D attn_mask is"):
        layer(x, x, x, attn_mask=fl.zeros(3, 4))
    with pytest.raises(AssertionError, match="only bool and floating types of attn_mask"):
        layer(x, x, x, attn_mask=fl.zeros(4, 4, dtype=fl.int32))
    with pytest.raises(AssertionError, match="query should be unbatched 2D or batched 3D"):
        layer(fl.zeros(8), fl.zeros(8), fl.zeros(8))
    with pytest.raises(AssertionError, match="Expected key_padded_mask.shape"):
        layer(x, x, x, key_padding_mask=fl.zeros(2, 3, dtype=fl.bool))


def test_multihead_attention_dropout_in_training(reference_backend, rng):
    """Training with dropout: the same seed gives the same result; eval gives no dropout."""
    layer = L["MultiheadAttention"](8, 2, dropout=0.5)
    x = fl.tensor(rng.standard_normal((4, 2, 8)).astype(np.float32))
    results = []
    for need_weights in (True, False):
        fl.manual_seed(5)
        first = layer(x, x, x, need_weights=need_weights)[0].numpy()
        fl.manual_seed(5)
        second = layer(x, x, x, need_weights=need_weights)[0].numpy()
        np.testing.assert_array_equal(first, second)
        results.append(first)
    layer.eval()
    plain = layer(x, x, x)[0].numpy()
    assert not np.allclose(plain, results[0])


# --- GPU tier: the CUDA backend against the reference backend ----------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(
    "name, args, shape",
    [("GELU", (), (4, 33)), ("MaxPool2d", (3, 2, 1), (2, 3, 9, 9)),
     ("AvgPool2d", (2,), (2, 3, 8, 8)), ("Upsample", (None, 2, "bilinear"), (2, 3, 5, 6)),
     ("PixelShuffle", (2,), (2, 8, 3, 3)), ("Softmax", (-1,), (5, 70)),
     ("Flatten", (), (2, 3, 4))],
)  # fmt: skip
def test_cuda_matches_reference(name, args, shape, rng):
    x = rng.standard_normal(shape).astype(np.float32)
    grad = None
    results = {}
    for backend_name in ("reference", "cuda"):
        with fl.backend(backend_name):
            layer = L[name](*args)
            xf = fl.tensor(x).requires_grad_()
            out = layer(xf)
            if grad is None:
                grad = rng.standard_normal(out.shape).astype(np.float32)
            (out * fl.tensor(grad)).sum().backward()
            results[backend_name] = (out.numpy(), xf.grad.numpy())
    for reference, cuda in zip(results["reference"], results["cuda"]):
        np.testing.assert_allclose(cuda, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("need_weights", [True, False])
def test_cuda_multihead_attention_matches_reference(need_weights, rng):
    x = rng.standard_normal((6, 2, 16)).astype(np.float32)
    mask = _bool_mask(rng, (2, 6))
    results = {}
    with fl.backend("reference"):
        fl.manual_seed(1)
        reference = L["MultiheadAttention"](16, 4)
        state = {key: value.numpy().copy() for key, value in reference.state_dict().items()}
    for backend_name in ("reference", "cuda"):
        with fl.backend(backend_name):
            layer = L["MultiheadAttention"](16, 4)
            layer.load_state_dict(state)
            xf = fl.tensor(x).requires_grad_()
            out, _ = layer(xf, xf, xf, key_padding_mask=fl.tensor(mask),
                           need_weights=need_weights)  # fmt: skip
            (out * out).sum().backward()
            results[backend_name] = (
                out.numpy(),
                xf.grad.numpy(),
                layer.in_proj_weight.grad.numpy(),
            )
    for reference, cuda in zip(results["reference"], results["cuda"]):
        np.testing.assert_allclose(cuda, reference, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("need_weights", [True, False])
def test_multihead_attention_is_causal_hint_as_pytorchs(need_weights, reference_backend, rng,
                                                        tmp_path):  # fmt: skip
    """As PyTorch's: without weights or a padding mask, ``is_causal`` replaces attn_mask by
    the causal mask; with weights, attn_mask is used as given."""
    torch = pytest.importorskip("torch")
    ours, theirs = _mha_pair(torch, tmp_path, 8, 2)
    x = rng.standard_normal((5, 2, 8)).astype(np.float32)
    loose = np.zeros((5, 5), dtype=np.float32)  # masks nothing: only the hint is causal
    _mha_check(
        torch, ours, theirs, [x, x, x], rng, need_weights=need_weights, is_causal=True,
        masks={"key_padding_mask": None, "attn_mask": loose},
    )  # fmt: skip


@pytest.mark.parametrize("need_weights", [True, False])
def test_multihead_attention_fully_masked_rows_as_pytorchs(need_weights, reference_backend, rng,
                                                           tmp_path):  # fmt: skip
    """A sample whose every key is padded: NaN with explicit weights, the fused path's safe
    softmax (zeros, then out_proj's bias) without, as PyTorch's."""
    torch = pytest.importorskip("torch")
    ours, theirs = _mha_pair(torch, tmp_path, 8, 2)
    x = rng.standard_normal((4, 2, 8)).astype(np.float32)
    padding = np.zeros((2, 4), dtype=bool)
    padding[1] = True
    out_f, _ = ours(*[fl.tensor(x)] * 3, key_padding_mask=fl.tensor(padding),
                    need_weights=need_weights)  # fmt: skip
    out_t, _ = theirs(*[torch.from_numpy(x)] * 3, key_padding_mask=torch.from_numpy(padding),
                      need_weights=need_weights)  # fmt: skip
    np.testing.assert_allclose(out_f.numpy(), out_t.detach().numpy(), rtol=2e-5, atol=2e-5)
    assert np.isnan(out_f.numpy()[:, 1]).all() == need_weights
