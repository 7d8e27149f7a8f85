"""``interpolate(mode="bicubic")`` and ``antialias=True`` (bilinear, bicubic) against PyTorch:
values and gradients over a table of resizes (up, down, odd sizes, ``size`` or
``scale_factor``, ``recompute_scale_factor``, ``align_corners`` either way) in float32 and
float64; float64 central differences; ``fl.compile``; the CUDA kernels compile with NVRTC;
``nn.Upsample``; the errors; the GPU against the reference (gpu tier)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from gradcheck import check_against_finite_differences, check_against_torch
from opinfo import assert_compiled_matches_lazy, assert_user_error, compile_plan_kernels

import flame as fl
import flame.nn as nn
import flame.nn.functional as F

RESIZES = [
    # (size, scale_factor, recompute_scale_factor)
    ((5, 11), None, None), (None, 2, None), (None, 1.7, None), (None, (0.5, 2.3), None),
    (None, 1.7, True), (14, None, None), (None, 0.3, None), ((3, 3), None, None),
    ((7, 8), None, None), ((1, 1), None, None), ((2, 16), None, None), (None, 0.5, True),
]  # fmt: skip
SHAPES = [(2, 3, 7, 8), (1, 2, 5, 13)]
TOLERANCES = {np.float32: (1e-4, 1e-5), np.float64: (1e-10, 1e-12)}
MODES = [("bicubic", False), ("bicubic", True), ("bilinear", True)]  # (mode, antialias)


def _case_id(value) -> str:
    return str(value).replace(" ", "")


CASES = [
    pytest.param(mode, antialias, align, resize, dtype,
                 id=f"{mode}-aa{int(antialias)}-align{int(align)}-{_case_id(resize)}-"
                    f"{dtype.__name__}")
    for mode, antialias in MODES
    for align in (False, True)
    for resize in RESIZES
    for dtype in (np.float32, np.float64)
]  # fmt: skip


def _resize(module, mode, antialias, align, resize):
    size, scale_factor, recompute = resize
    return lambda x: module.interpolate(
        x, size, scale_factor, mode, align, recompute, antialias=antialias
    )


@pytest.mark.parametrize("mode, antialias, align, resize, dtype", CASES)
def test_matches_torch_values_and_gradients(mode, antialias, align, resize, dtype, rng):
    torch = pytest.importorskip("torch")
    rtol, atol = TOLERANCES[dtype]
    for shape in SHAPES:
        x = rng.standard_normal(shape).astype(dtype)
        check_against_torch(
            _resize(F, mode, antialias, align, resize),
            _resize(torch.nn.functional, mode, antialias, align, resize),
            [x], [0], rng, rtol=rtol, atol=atol,
        )  # fmt: skip


@pytest.mark.parametrize("mode, antialias", MODES)
@pytest.mark.parametrize("size", [(3, 7), (6, 2)])
def test_gradient_matches_central_differences(mode, antialias, size, rng):
    x = rng.standard_normal((1, 2, 4, 5)).astype(np.float32)
    build = _resize(F, mode, antialias, False, (size, None, None))
    check_against_finite_differences(build, [x], [0], rng)


def test_bicubic_keeps_the_grid_points_with_align_corners(rng, reference_backend):
    """Without PyTorch: with align_corners the input's samples reappear every other output
    (the kernel is 1 at 0 and 0 at the other integers), and a constant stays constant."""
    x = rng.standard_normal((1, 2, 3, 4)).astype(np.float32)
    out = F.interpolate(fl.from_numpy(x), size=(5, 7), mode="bicubic", align_corners=True)
    np.testing.assert_allclose(out.numpy()[..., ::2, ::2], x, rtol=1e-6, atol=1e-6)
    flat = F.interpolate(fl.full((1, 1, 4, 4), 2.5), scale_factor=0.3, mode="bicubic")
    np.testing.assert_allclose(flat.numpy(), 2.5, rtol=1e-6)


def test_antialias_averages_the_footprint(reference_backend):
    """Without PyTorch: halving with the antialiased triangle filter averages 4 inputs with
    weights 1/8, 3/8, 3/8, 1/8 (one at each border renormalised)."""
    x = np.arange(8, dtype=np.float64).reshape(1, 1, 1, 8)
    out = F.interpolate(fl.from_numpy(x), size=(1, 4), mode="bilinear", antialias=True)
    inner = (1 * 1 + 3 * 2 + 3 * 3 + 1 * 4) / 8
    np.testing.assert_allclose(out.numpy()[0, 0, 0, 1], inner, rtol=1e-12)
    np.testing.assert_allclose(out.numpy()[0, 0, 0, 0], (3 * 0 + 3 * 1 + 1 * 2) / 7, rtol=1e-12)


@pytest.mark.parametrize("mode, antialias", MODES)
def test_compiled_matches_lazy_with_gradients(mode, antialias, rng, reference_backend):
    x = fl.tensor(rng.standard_normal((2, 3, 9, 6)).astype(np.float32)).requires_grad_()
    seed = fl.tensor(rng.standard_normal((2, 3, 4, 11)).astype(np.float32))
    resize = functools.partial(F.interpolate, size=(4, 11), mode=mode, antialias=antialias)
    assert_compiled_matches_lazy(resize, x, seed)


@pytest.mark.parametrize("mode, antialias", MODES)
def test_cuda_kernels_compile_with_nvrtc(mode, antialias, cuda_backend, nvrtc, rng):
    """Forward and gradient as one CUDA plan (the gathers are library calls): every fused
    kernel compiles; building it needs no GPU."""
    x = fl.from_numpy(rng.standard_normal((2, 3, 9, 6)).astype(np.float32))
    out, pullback = fl.vjp(
        lambda x: F.interpolate(x, size=(4, 11), mode=mode, antialias=antialias), x
    )
    (grad,) = pullback(fl.ones(out.shape))
    for cubin in compile_plan_kernels([out.node, grad.node]):
        assert cubin[:4] == b"\x7fELF"


@pytest.mark.parametrize("mode, antialias", MODES)
def test_upsample_module_matches_torch(mode, antialias, rng, reference_backend):
    torch = pytest.importorskip("torch")
    x = rng.standard_normal((2, 3, 5, 6)).astype(np.float32)
    ours = nn.Upsample(scale_factor=1.5, mode=mode, align_corners=False)
    theirs = torch.nn.Upsample(scale_factor=1.5, mode=mode, align_corners=False)
    assert repr(ours) == repr(theirs)
    expected = theirs(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(ours(fl.from_numpy(x)).numpy(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda x: F.interpolate(x[0], size=4, mode="bicubic"), NotImplementedError,
         ["interpolate", "[3, 6, 5]", "'bicubic'", "4-d"]),
        (lambda x: F.interpolate(x, size=4, mode="nearest", antialias=True), ValueError,
         ["interpolate", "antialias", "'nearest'", "[2, 3, 6, 5]"]),
        (lambda x: F.interpolate(x[0], size=4, mode="bilinear", antialias=True), ValueError,
         ["interpolate", "antialias", "[3, 6, 5]"]),
        (lambda x: F.interpolate(x, size=(4, 4, 4), mode="bicubic"), ValueError,
         ["interpolate", "size", "[4, 4, 4]", "2 spatial dims"]),
    ],
)  # fmt: skip
def test_errors_name_the_op_shape_and_argument(call, error, words, reference_backend):
    x = fl.zeros((2, 3, 6, 5))
    assert_user_error(lambda: call(x), error, words, at="test_interpolate_bicubic.py")


@pytest.mark.gpu
@pytest.mark.parametrize("mode, antialias", MODES)
def test_gpu_matches_reference(mode, antialias, rng):
    x = rng.standard_normal((2, 3, 19, 12)).astype(np.float32)
    seed = rng.standard_normal((2, 3, 7, 30)).astype(np.float32)
    results = {}
    for backend_name in ("reference", "cuda"):
        with fl.backend(backend_name):
            tensor = fl.from_numpy(x)
            out, pullback = fl.vjp(
                lambda x: F.interpolate(x, (7, 30), mode=mode, antialias=antialias), tensor
            )
            (grad,) = pullback(fl.from_numpy(seed))
            results[backend_name] = (out.numpy(), grad.numpy())
    for cuda, reference in zip(results["cuda"], results["reference"], strict=True):
        np.testing.assert_allclose(cuda, reference, rtol=1e-5, atol=1e-5)
