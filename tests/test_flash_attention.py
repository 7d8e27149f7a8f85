"""FLAME's fused attention kernels (flame/runtime/flash_attention.py).

CPU tier: every kernel variant renders, and NVRTC compiles them for sm_90 (skipped without
NVRTC); ``supports`` says what is handled. GPU tier: forward (o, lse) and backward (dq, dk, dv)
against a float64 NumPy reference computed from the same rounded inputs, over a table of head
dims, odd and power-of-two lengths, causal or not, biases (full, broadcast with stride-0 axes,
-inf entries, a fully masked row), grouped-query heads, bfloat16 and float16.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from flame.runtime import flash_attention as fa

HEAD_DIMS = [(8, 8), (32, 32), (40, 40), (64, 64), (72, 72), (80, 80), (128, 128), (160, 160),
             (256, 256), (64, 128), (128, 64), (40, 72)]  # fmt: skip
FLAGS = [(False, False), (True, False), (False, True), (True, True)]  # (causal, bias)


# --- CPU tier ---------------------------------------------------------------------------------


def test_supports():
    assert fa.supports(64, 64, "bfloat16") is None
    assert fa.supports(256, 128, "float16") is None
    assert "float32" in fa.supports(64, 64, "float32")
    assert "multiple of 8" in fa.supports(60, 60, "bfloat16")
    assert "value head dim" in fa.supports(64, 264, "bfloat16")


@pytest.mark.parametrize("part", ["forward", "backward"])
def test_every_variant_renders_with_sizes_left_out(part):
    sources = {}
    for dtype in ("bfloat16", "float16"):
        for head_dim, value_dim in HEAD_DIMS:
            for causal, bias in FLAGS:
                name, source = fa.render(part, dtype, head_dim, value_dim, causal, bias)
                assert f"{name}_{part}" in source
                sources[(dtype, head_dim, value_dim, causal, bias)] = source
    assert len(set(sources.values())) == len(sources)  # every key is a distinct kernel


def test_shared_memory_fits_an_h100():
    for head_dim, value_dim in HEAD_DIMS:
        assert fa.forward_shared_bytes(head_dim, value_dim) <= 227 * 1024
        assert fa.backward_shared_bytes(head_dim, value_dim) <= 227 * 1024


def _compile_cases():
    """Every head-dim pair in bfloat16 with the flags taken in turn, every flag for the common
    head dims, and float16 (which changes only the PTX type) for a few."""
    cases = []
    for index, (head_dim, value_dim) in enumerate(HEAD_DIMS):
        cases.append(("bfloat16", head_dim, value_dim, *FLAGS[index % len(FLAGS)]))
    for head_dim in (64, 128):
        cases += [("bfloat16", head_dim, head_dim, *flags) for flags in FLAGS]
    cases += [("float16", dim, dim, True, True) for dim in (40, 128, 256)]
    return sorted(set(cases))


@pytest.mark.parametrize("part", ["forward", "backward"])
def test_variants_compile_for_sm90(part, nvrtc):
    from flame.runtime.compiler import nvrtc_compile

    def compile_one(case):
        name, source = fa.render(part, *case)
        return case, nvrtc_compile(source, name, "sm_90")

    with ThreadPoolExecutor(max_workers=4) as pool:
        for case, cubin in pool.map(compile_one, _compile_cases()):
            assert len(cubin) > 1000, case


# tile configurations the bench A/Bs (FLAME_FLASH_TILES): each must compile and be right
TILE_VARIANTS = ["fwd=4x1x64q,bwd=4x64", "fwd=4x2x32", "fwd=4x2x64q", "fwd=8x1x64,bwd=8x64",
                 "bwd=8x32", "fwd=4x2x32x3,bwd=4x32x1", "fwd=4x2x64x3q,bwd=4x64x1",
                 "fwd=4x1x64x2q", "bwd=8x64p", "bwd=4x32p", "bwd=4x64p"]  # fmt: skip


def test_tiles_override(monkeypatch):
    monkeypatch.delenv(fa.TILES_VARIABLE, raising=False)
    default = fa.tiles(64, 64)
    monkeypatch.setenv(fa.TILES_VARIABLE, "fwd=8x1x32q,bwd=8x64")
    assert fa.tiles(64, 64) == (fa.ForwardTiles(8, 1, 32, True), fa.BackwardTiles(8, 64, True))
    monkeypatch.setenv(fa.TILES_VARIABLE, "bwd=8x64")
    assert fa.tiles(64, 64) == (default[0], fa.BackwardTiles(8, 64, True))
    assert fa.tiles(256, 256) == fa.tiles(256, 200)  # above 128: never overridden
    monkeypatch.setenv(fa.TILES_VARIABLE, "fwd=4x2x32x3,bwd=4x32x1")
    assert fa.tiles(64, 64) == (fa.ForwardTiles(4, 2, 32, False, 3),
                                fa.BackwardTiles(4, 32, True, 1))  # fmt: skip
    assert fa.tiles(256, 256)[1].buffers == 1  # two would cost the second block an SM
    monkeypatch.setenv(fa.TILES_VARIABLE, "bwd=8x64p")
    assert fa.tiles(128, 128)[1] == fa.BackwardTiles(8, 64, True, 2, True)
    assert fa.tiles(40, 40)[1] == fa.BackwardTiles(8, 64, True, 2)  # 48 columns: plain layout
    for bad in ("bwd=7x64p", "bwd=8x48p", "bwd=8x64x1p", "bwd=2x128p"):
        monkeypatch.setenv(fa.TILES_VARIABLE, bad)
        with pytest.raises(ValueError, match="FLAME_FLASH_TILES"):
            fa.tiles(64, 64)
    monkeypatch.setenv(fa.TILES_VARIABLE, "fwd=4x2")
    with pytest.raises(ValueError, match="FLAME_FLASH_TILES"):
        fa.tiles(64, 64)


@pytest.mark.parametrize("tiles", TILE_VARIANTS)
def test_tile_variants_compile_for_sm90(tiles, nvrtc, monkeypatch):
    from flame.runtime.compiler import nvrtc_compile

    monkeypatch.setenv(fa.TILES_VARIABLE, tiles)
    for part in ("forward", "backward"):
        for case in (("bfloat16", 64, 64, True, False), ("bfloat16", 128, 128, False, True)):
            name, source = fa.render(part, *case)
            assert len(nvrtc_compile(source, name, "sm_90")) > 1000, (tiles, part, case)
        assert fa.forward_shared_bytes(128, 128) <= 227 * 1024
        assert fa.backward_shared_bytes(128, 128) <= 227 * 1024


def test_reference_masks_rows_and_sums_gqa_heads(rng):
    q = rng.standard_normal((1, 4, 5, 8))
    k = rng.standard_normal((1, 2, 6, 8))
    v = rng.standard_normal((1, 2, 6, 8))
    bias = np.zeros((1, 4, 5, 6))
    bias[0, 1, 2] = -np.inf
    do = rng.standard_normal((1, 4, 5, 8))
    o, lse, dq, dk, dv = reference(q, k, v, do, 0.3, False, bias)
    assert o[0, 1, 2].tolist() == [0.0] * 8 and lse[0, 1, 2] == -np.inf
    assert not np.isnan(dq).any() and not dq[0, 1, 2].any()
    # head 0 and 1 share kv head 0: its dv is the sum of theirs
    single = reference(q[:, :2], k[:, :1], v[:, :1], do[:, :2], 0.3, False, bias[:, :2])
    np.testing.assert_allclose(dv[:, :1], single[4], rtol=1e-12)


# --- reference --------------------------------------------------------------------------------


def reference(q, k, v, do, scale, causal, bias):
    """float64 attention and its gradients; k, v have Hk heads, shared by Hq / Hk query heads."""
    group = q.shape[1] // k.shape[1]
    kx, vx = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s = scale * q @ kx.swapaxes(-1, -2)
    if bias is not None:
        s = s + bias
    if causal:
        lq, lk = s.shape[-2:]
        s = np.where(np.arange(lk)[None, :] > np.arange(lq)[:, None], -np.inf, s)
    top = s.max(axis=-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    e = np.exp(s - top)
    total = e.sum(axis=-1, keepdims=True)
    p = np.where(total > 0, e / np.where(total > 0, total, 1.0), 0.0)
    with np.errstate(divide="ignore"):
        lse = np.where(total > 0, np.log(total) + top, -np.inf)[..., 0]
    o = p @ vx
    dvx = p.swapaxes(-1, -2) @ do
    dp = do @ vx.swapaxes(-1, -2)
    delta = (do * o).sum(axis=-1, keepdims=True)
    ds = p * (dp - delta)
    dq = scale * ds @ kx
    dkx = scale * ds.swapaxes(-1, -2) @ q
    batch, kv_heads = k.shape[:2]
    dk = dkx.reshape(batch, kv_heads, group, *dkx.shape[2:]).sum(axis=2)
    dv = dvx.reshape(batch, kv_heads, group, *dvx.shape[2:]).sum(axis=2)
    return o, lse, dq, dk, dv


# --- GPU tier ---------------------------------------------------------------------------------


def _round(values, dtype):
    """(storage array for the GPU, the float64 values it holds)."""
    if dtype == "float16":
        half = values.astype(np.float16)
        return half, half.astype(np.float64)
    bits = values.astype(np.float32).view(np.uint32).astype(np.uint64)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return bits, (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _values(array, dtype):
    import cupy

    host = cupy.asnumpy(array)
    if dtype == "bfloat16":
        return (host.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return host.astype(np.float64)


def _bias(kind, rng, batch, heads, lq, lk):
    """(float32 device bias, float64 host values) of one kind, or (None, None)."""
    import cupy

    if kind is None:
        return None, None
    if kind == "full":
        values = rng.standard_normal((batch, heads, lq, lk)).astype(np.float32)
        values[rng.random(values.shape) < 0.1] = -np.inf
        values[0, -1, lq // 2] = -np.inf  # one fully masked row
        device = cupy.asarray(values)
    elif kind == "broadcast":  # [Lq, Lk] shared by every batch and head: stride 0 on both
        values = rng.standard_normal((1, 1, lq, lk)).astype(np.float32)
        values[rng.random(values.shape) < 0.2] = -np.inf
        values[0, 0, min(3, lq - 1)] = -np.inf  # a fully masked row in every (batch, head)
        device = cupy.broadcast_to(cupy.asarray(values), (batch, heads, lq, lk))
    else:  # "key_padding": [B, 1, 1, Lk], stride 0 on heads and queries
        values = np.zeros((batch, 1, 1, lk), dtype=np.float32)
        values[..., max(1, lk - 3) :] = -np.inf
        device = cupy.broadcast_to(cupy.asarray(values), (batch, heads, lq, lk))
    return device, np.broadcast_to(values.astype(np.float64), (batch, heads, lq, lk))


def _assert_close(name, got, want, tol):
    assert got.shape == want.shape, (name, got.shape, want.shape)
    assert not np.isnan(got).any(), f"{name}: NaN"
    error = np.abs(got - want).max() if got.size else 0.0
    size = max(np.abs(want).max() if want.size else 0.0, 1e-3)
    assert error <= tol * size, f"{name}: max error {error:.3g} > {tol} * {size:.3g}"


TOLERANCE = {"bfloat16": (2e-2, 4e-2), "float16": (4e-3, 1e-2)}  # (o, gradients)

# batch, query heads, kv heads, Lq, Lk, D, Dv, causal, bias
CASES = [
    (1, 2, 2, 1, 1, 64, 64, False, None),
    (2, 2, 2, 17, 100, 32, 32, False, None),
    (1, 2, 2, 100, 17, 40, 40, True, None),
    (1, 4, 2, 257, 257, 64, 64, True, None),
    (2, 4, 1, 128, 256, 72, 72, False, "full"),
    (1, 2, 2, 256, 256, 80, 80, True, "broadcast"),
    (1, 2, 2, 100, 257, 128, 128, False, "broadcast"),
    (2, 4, 2, 64, 64, 128, 128, True, "key_padding"),
    (1, 4, 1, 17, 33, 160, 160, False, None),
    (1, 2, 2, 100, 100, 256, 256, True, "full"),
    (1, 2, 2, 257, 64, 256, 256, False, None),
    (1, 2, 2, 130, 70, 64, 128, False, None),
    (1, 2, 2, 70, 130, 128, 64, True, "broadcast"),
    (1, 1, 1, 1024, 1024, 64, 64, True, None),
    (1, 2, 1, 512, 1024, 128, 128, False, None),
    (1, 2, 2, 33, 1, 64, 64, True, None),
    (1, 2, 2, 257, 100, 8, 8, True, "full"),
]


def _case_id(case):
    batch, heads, kv_heads, lq, lk, head_dim, value_dim, causal, bias = case
    shape = f"b{batch}h{heads}k{kv_heads}-{lq}x{lk}-d{head_dim}v{value_dim}"
    return shape + ("-causal" if causal else "") + (f"-{bias}" if bias else "")


def _run(case, dtype, rng, layout=None):
    import cupy

    batch, heads, kv_heads, lq, lk, head_dim, value_dim, causal, bias_kind = case
    scale = 1.0 / math.sqrt(head_dim)
    arrays, host = {}, {}
    shapes = {
        "q": (batch, heads, lq, head_dim),
        "k": (batch, kv_heads, lk, head_dim),
        "v": (batch, kv_heads, lk, value_dim),
        "do": (batch, heads, lq, value_dim),
    }
    for name, shape in shapes.items():
        stored, host[name] = _round(rng.standard_normal(shape), dtype)
        arrays[name] = cupy.asarray(stored)
    if layout is not None:
        arrays = {name: layout(array) for name, array in arrays.items()}
    bias, bias_host = _bias(bias_kind, rng, batch, heads, lq, lk)
    o, lse = fa.forward(arrays["q"], arrays["k"], arrays["v"], scale=scale, causal=causal,
                        dtype=dtype, bias=bias)  # fmt: skip
    dq, dk, dv = fa.backward(arrays["q"], arrays["k"], arrays["v"], o, arrays["do"], lse,
                             scale=scale, causal=causal, dtype=dtype, bias=bias)  # fmt: skip
    want = reference(host["q"], host["k"], host["v"], host["do"], scale, causal, bias_host)
    got = (_values(o, dtype), cupy.asnumpy(lse), _values(dq, dtype), _values(dk, dtype),
           _values(dv, dtype))  # fmt: skip
    for array in (o, lse, dq, dk, dv):
        assert array.flags.c_contiguous
    return got, want


def _compare(got, want, dtype):
    o_tol, grad_tol = TOLERANCE[dtype]
    o, lse, dq, dk, dv = got
    want_o, want_lse, want_dq, want_dk, want_dv = want
    masked = np.isneginf(want_lse)
    assert (lse[masked] == -np.inf).all(), "lse of a fully masked row must be -inf"
    assert not o[masked].any() and not dq[masked].any(), "a fully masked row: o = dq = 0"
    assert np.isfinite(lse[~masked]).all()
    np.testing.assert_allclose(lse[~masked], want_lse[~masked], atol=1e-2, rtol=1e-3)
    _assert_close("o", o, want_o, o_tol)
    _assert_close("dq", dq, want_dq, grad_tol)
    _assert_close("dk", dk, want_dk, grad_tol)
    _assert_close("dv", dv, want_dv, grad_tol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_matches_float64_reference(case, dtype, rng):
    got, want = _run(case, dtype, rng)
    _compare(got, want, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", TILE_VARIANTS)
def test_tile_variants_match_reference(tiles, rng, monkeypatch):
    monkeypatch.setenv(fa.TILES_VARIABLE, tiles)
    for case in ((1, 2, 1, 300, 200, 64, 64, True, None), (2, 2, 2, 130, 257, 128, 128, False,
                 "key_padding"), (1, 2, 2, 257, 257, 64, 64, False, "full")):  # fmt: skip
        got, want = _run(case, "bfloat16", rng)
        _compare(got, want, "bfloat16")


@pytest.mark.gpu
def test_negative_scale_goes_through_the_bias_variant(rng):
    import cupy

    case = (1, 2, 2, 70, 90, 64, 64, False, None)
    batch, heads, _, lq, lk, head_dim, value_dim, _, _ = case
    q, hq = _round(rng.standard_normal((batch, heads, lq, head_dim)), "bfloat16")
    k, hk = _round(rng.standard_normal((batch, heads, lk, head_dim)), "bfloat16")
    v, hv = _round(rng.standard_normal((batch, heads, lk, value_dim)), "bfloat16")
    o, lse = fa.forward(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), scale=-0.2,
                        causal=False, dtype="bfloat16")  # fmt: skip
    want_o, want_lse, *_ = reference(hq, hk, hv, np.zeros_like(hq), -0.2, False, None)
    _assert_close("o", _values(o, "bfloat16"), want_o, TOLERANCE["bfloat16"][0])
    np.testing.assert_allclose(cupy.asnumpy(lse), want_lse, atol=1e-2, rtol=1e-3)


@pytest.mark.gpu
def test_strided_views_are_read_in_place_or_copied(rng):
    import cupy

    def transposed(array):  # [B, H, L, D] values seen through a [B, L, H, D] buffer
        return cupy.ascontiguousarray(array.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)

    def misaligned(array):  # rows 2 bytes off 16: the wrapper must copy
        shape = array.shape
        wide = cupy.zeros((*shape[:3], shape[3] + 1), dtype=array.dtype)
        wide[..., 1:] = array
        return wide[..., 1:]

    case = (2, 4, 2, 100, 77, 64, 64, True, "broadcast")
    for layout in (transposed, misaligned):
        got, want = _run(case, "bfloat16", rng, layout)
        _compare(got, want, "bfloat16")


@pytest.mark.gpu
def test_zero_sized_inputs_launch_nothing():
    import cupy

    def empty(*shape):
        return cupy.zeros(shape, dtype=np.uint16)

    o, lse = fa.forward(empty(1, 2, 5, 64), empty(1, 2, 0, 64), empty(1, 2, 0, 64), scale=0.1,
                        causal=False, dtype="bfloat16")  # fmt: skip
    assert o.shape == (1, 2, 5, 64) and not o.any() and bool(cupy.isneginf(lse).all())
    dq, dk, dv = fa.backward(empty(1, 2, 5, 64), empty(1, 2, 0, 64), empty(1, 2, 0, 64), o,
                             empty(1, 2, 5, 64), lse, scale=0.1, causal=False,
                             dtype="bfloat16")  # fmt: skip
    assert dq.shape == (1, 2, 5, 64) and not dq.any() and dk.shape == (1, 2, 0, 64)
    o, lse = fa.forward(empty(0, 2, 5, 64), empty(0, 2, 3, 64), empty(0, 2, 3, 64), scale=0.1,
                        causal=True, dtype="bfloat16")  # fmt: skip
    assert o.shape == (0, 2, 5, 64) and lse.shape == (0, 2, 5)
    q, k = empty(1, 2, 0, 64), empty(1, 2, 3, 64)
    o, lse = fa.forward(q, k, k, scale=0.1, causal=False, dtype="bfloat16")
    dq, dk, dv = fa.backward(q, k, k, o, o, lse, scale=0.1, causal=False, dtype="bfloat16")
    assert dk.shape == (1, 2, 3, 64) and not dk.any() and not dv.any()


@pytest.mark.gpu
def test_new_sizes_reuse_the_compiled_kernel(rng):
    base = (1, 2, 2, 40, 50, 64, 64, False, None)
    _run(base, "bfloat16", rng)
    before = len(fa._functions)
    _run((3, 4, 4, 300, 123, 64, 64, False, None), "bfloat16", rng)
    assert len(fa._functions) == before
