"""Fused (flash) attention on the GPU: FLAME's own kernels behind
``F.scaled_dot_product_attention`` where cuDNN refuses a case or is absent.

Memory stays linear in the sequence lengths: scores are never stored whole. The kernels
(``templates/flash_attention.cu.j2``) follow FlashAttention-2: tensor cores through inline PTX
(``mma.sync.m16n8k16`` with bfloat16 or float16 inputs and float32 accumulators, ``ldmatrix``,
``cp.async``), the softmax computed online in registers, tiles in shared memory.

* forward: a block takes ``16 * m_tiles * warps`` query rows of one (batch, query head), a
  warp ``16 * m_tiles`` of them (32 up to head dim 128: each K/V fragment feeds two mma), and
  walks the key tiles (K and V loaded ``stages - 1`` tiles ahead); it writes ``o`` and the
  natural-log ``lse`` of each row.
* backward: ``delta = rowsum(dO * O)`` and ``lse log2 e`` first (one warp a row); then a
  block takes ``16 * warps`` keys of one (batch, kv head) and walks every query head of its
  group and every query tile (the next one loading a whole tile ahead). dK and dV stay with
  the thread that owns them (registers up to head dim 128, a float32 global scratch beyond),
  so they need no atomics and GQA's sum over the query heads of a group is a loop. **dQ is
  accumulated with float32 reductions in a scratch buffer**
  (``red.global.add.v4.f32`` on sm_90: 4 elements an instruction) and converted to the input
  dtype by a last small kernel.

What is compiled in (the kernel key): the part (forward or backward), the dtype, the head dims
``D`` and ``Dv``, ``causal``, whether there is a bias, whether there is dropout, and the tile
configuration, which is a function of ``max(D, Dv)`` (``tiles``). Batch, heads, lengths, every
stride and dropout's probability are kernel arguments: new sizes or a new ``p`` never
recompile.

Dropout (a template switch: the kernels without it are unchanged): both parts draw the mask
of ``flame.ir.ops.attention.dropout_keep`` in registers from the (seed, offset) int64 pair
they read from memory, one Philox-4x32-10 call a 2 x 2 block of scores (two of which a thread
holds); the forward adds only the kept probabilities to O (the row statistics stay those of
the whole softmax), the backward routes dP through the same mask, so the gradients are those
of the forward's mask.

Inputs may be strided views with a unit last stride. The kernels read rows 16 bytes at a time,
so a view whose base or row strides are not multiples of 16 bytes is copied first.

GPU tests: ``tests/test_flash_attention.py -m gpu``; speed:
``notes/probes/flash_attention_bench.py`` (``--tiles`` A/Bs ``FLAME_FLASH_TILES`` values);
analysis and tile choices: ``notes/flash-attention.md``.
"""

from __future__ import annotations

import math
import os
import threading
from typing import NamedTuple

import numpy as np

TEMPLATE = "flash_attention.cu.j2"
PTX_TYPES = {"bfloat16": "bf16", "float16": "f16"}
MAX_HEAD_DIM = 256
ALIGN_ELEMENTS = 8  # 16 bytes of 16-bit elements: one cp.async chunk
MAX_QUERY_TILES = 65535  # grid.y
DELTA_WARPS = 8
CONVERT_BLOCK = 256


class ForwardTiles(NamedTuple):
    warps: int  # query rows per block: 16 * m_tiles * warps
    m_tiles: int  # 16-row mma tiles a warp owns: each K/V fragment read feeds m_tiles mma
    block_keys: int  # keys per tile
    q_in_registers: bool  # Q's A fragments kept in registers across key tiles
    stages: int = 2  # K/V tile buffers: tile j + stages - 1 loads while tile j is computed


class BackwardTiles(NamedTuple):
    warps: int  # keys per block: 16 * warps
    block_queries: int  # queries per tile
    accumulate_in_registers: bool  # dK, dV in registers, else in a float32 global scratch
    buffers: int = 2  # Q/dO/dS buffers: 2 = the next query tile loads a whole tile ahead
    # warps in pairs: a pair owns 32 keys, its two warps split the queries of S^T/dP^T and the
    # columns of dK/dV (P^T and dS^T through shared memory); needs even warps, block_queries
    # a multiple of 32, padded head dims multiples of 32, and two buffers
    paired: bool = False


TILES_VARIABLE = "FLAME_FLASH_TILES"


def tiles(head_dim: int, value_dim: int) -> tuple[ForwardTiles, BackwardTiles]:
    """The tile configuration for a pair of head dims, sized so registers and shared memory
    fit (see notes/flash-attention.md). ``FLAME_FLASH_TILES`` overrides it for head dims up to
    128, for A/B runs: ``fwd=WxMxBC[xS][q],bwd=WxBR[xN][p]`` (either part may be left out;
    ``q``: Q in registers; S: K/V stages, default 2; N: Q/dO buffers, 1 or 2, default 2; ``p``:
    the paired backward layout, ``BackwardTiles.paired``), e.g. ``fwd=4x1x64x2q,bwd=4x64x1`` is
    close to the first, untuned configuration. Where a head dim does not allow the paired
    layout (padded dims not multiples of 32), it keeps the plain one."""
    widest = max(_padded(head_dim), _padded(value_dim))
    if widest <= 64:
        fwd, bwd = ForwardTiles(4, 2, 64, True), BackwardTiles(4, 64, True)
    elif widest <= 128:
        fwd, bwd = ForwardTiles(4, 2, 32, False), BackwardTiles(4, 32, True)
        if _padded(head_dim) % 32 == 0 and _padded(value_dim) % 32 == 0:
            # the paired layout, 8 warps, 64 queries a step: measured on the H100 at head dim
            # 128, forward + backward 0.43 -> 0.48-0.50x SDPA non-causal, 0.45-0.59 -> 0.51-0.64x
            # causal (notes/flash-attention.md, round 4)
            bwd = BackwardTiles(8, 64, True, paired=True)
    else:  # two Q/dO buffers would cost the backward its second block an SM
        return ForwardTiles(4, 1, 32, False), BackwardTiles(4, 32, False, 1)
    override = os.environ.get(TILES_VARIABLE, "").strip()
    if override:
        fwd, bwd = _parse_tiles(override, fwd, bwd)
        if bwd.paired and (_padded(head_dim) % 32 or _padded(value_dim) % 32):
            bwd = bwd._replace(paired=False)
    return fwd, bwd


def _parse_tiles(text: str, fwd: ForwardTiles, bwd: BackwardTiles):
    for part in text.replace(";", ",").split(","):
        if not part.strip():
            continue
        key, _, value = part.strip().partition("=")
        value = value.strip().lower()
        try:
            if key.strip() == "fwd":
                in_registers = value.endswith("q")
                numbers = [int(x) for x in value.rstrip("q").split("x")]
                if len(numbers) not in (3, 4):
                    raise ValueError(value)
                fwd = ForwardTiles(*numbers[:3], in_registers, *numbers[3:])
            elif key.strip() == "bwd":
                paired = value.endswith("p")
                numbers = [int(x) for x in value.rstrip("p").split("x")]
                if len(numbers) not in (2, 3):
                    raise ValueError(value)
                bwd = BackwardTiles(
                    *numbers[:2],
                    bwd.accumulate_in_registers,
                    *numbers[2:3],
                    **({"paired": True} if paired else {}),
                )
                if paired and (
                    bwd.warps % 2
                    or bwd.block_queries % 32
                    or bwd.buffers != 2
                    or bwd.warps % (bwd.block_queries // 32)
                ):
                    raise ValueError(value)
            else:
                raise ValueError(key)
        except ValueError:
            raise ValueError(
                f"{TILES_VARIABLE}={text!r}: expected fwd=WxMxBC[xS][q],bwd=WxBR[xN][p]"
            ) from None
    assert fwd.block_keys % 16 == 0 and bwd.block_queries % 16 == 0, (fwd, bwd)
    assert fwd.stages >= 2 and bwd.buffers in (1, 2), (fwd, bwd)
    return fwd, bwd


def _padded(dim: int) -> int:
    return -(-dim // 16) * 16


def forward_shared_bytes(head_dim: int, value_dim: int) -> int:
    fwd, _ = tiles(head_dim, value_dim)
    rows = 16 * fwd.m_tiles * fwd.warps
    q_stride, v_stride = _padded(head_dim) + 8, _padded(value_dim) + 8
    return 2 * (rows * q_stride + fwd.stages * fwd.block_keys * (q_stride + v_stride))


def backward_shared_bytes(head_dim: int, value_dim: int) -> int:
    _, bwd = tiles(head_dim, value_dim)
    keys, queries = 16 * bwd.warps, bwd.block_queries
    q_stride, v_stride = _padded(head_dim) + 8, _padded(value_dim) + 8
    # buffers of Q, dO, dS^T and the per-row lse, delta (paired: two of Q, dO, lse, delta and
    # one each of P^T and dS^T, the same bytes)
    buffers = bwd.buffers
    elements = (keys + buffers * queries) * (q_stride + v_stride) + buffers * keys * (queries + 8)
    return 2 * elements + 4 * 2 * queries * buffers


def supports(head_dim: int, value_dim: int, dtype_name: str) -> str | None:
    """None where these kernels handle the case, else the reason they do not."""
    if dtype_name not in PTX_TYPES:
        return f"flash attention kernels take bfloat16 or float16, not {dtype_name}"
    for label, dim in (("head dim", head_dim), ("value head dim", value_dim)):
        if dim % 8 or not 8 <= dim <= MAX_HEAD_DIM:
            return f"{label} {dim} is not a multiple of 8 in 8..{MAX_HEAD_DIM}"
    return None


# --- kernels ----------------------------------------------------------------------------------


def render(part: str, dtype_name: str, head_dim: int, value_dim: int, causal: bool,
           has_bias: bool, dropout: bool = False) -> tuple[str, str]:  # fmt: skip
    """(kernel name prefix, CUDA source) of ``part`` ("forward" or "backward")."""
    from flame.codegen.render import environment
    from flame.ir.ops.registry import HELPERS

    fwd, bwd = tiles(head_dim, value_dim)
    flags = ("c" if causal else "") + ("b" if has_bias else "") + ("d" if dropout else "")
    name = f"flame_flash_{PTX_TYPES[dtype_name]}_d{head_dim}_v{value_dim}_{flags or 'plain'}"
    template = environment().get_template(TEMPLATE)
    source = template.render(
        part=part,
        name=name,
        dtype=dtype_name,
        ptx_type=PTX_TYPES[dtype_name],
        head_dim=head_dim,
        value_dim=value_dim,
        head_dim_padded=_padded(head_dim),
        value_dim_padded=_padded(value_dim),
        causal=causal,
        has_bias=has_bias,
        dropout=dropout,
        philox_source=HELPERS["flame_philox"] if dropout else "",
        fwd=fwd,
        bwd=bwd,
    )
    return name, source


_functions: dict[tuple, dict] = {}
_modules: list = []  # a loaded module must outlive its functions
_lock = threading.Lock()


def _kernels(part: str, dtype_name: str, head_dim: int, value_dim: int, causal: bool,
             has_bias: bool, dropout: bool = False) -> dict:  # fmt: skip
    """The loaded functions of ``part`` by short name, compiled through FLAME's kernel cache."""
    # the tiles are a function of the head dims, or of FLAME_FLASH_TILES (A/B runs)
    key = (part, dtype_name, head_dim, value_dim, causal, has_bias, dropout,
           tiles(head_dim, value_dim))  # fmt: skip
    functions = _functions.get(key)
    if functions is not None:
        return functions
    import cupy
    from cupy.cuda import driver

    from flame.runtime.compiler import default_kernel_cache

    name, source = render(*key[:7])
    _, cubin = default_kernel_cache().cubin(source, f"{name}_{part}")
    entries = ("forward",) if part == "forward" else ("backward", "delta", "convert")
    shared_bytes = forward_shared_bytes if part == "forward" else backward_shared_bytes
    shared = shared_bytes(head_dim, value_dim)
    with _lock:
        if key not in _functions:
            module = cupy.cuda.function.Module()
            module.load(cubin)
            _modules.append(module)
            loaded = {entry: module.get_function(f"{name}_{entry}") for entry in entries}
            # above 48 KiB a block's dynamic shared memory must be asked for
            driver.funcSetAttribute(
                loaded[part].ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared
            )
            loaded["shared_bytes"] = shared
            _functions[key] = loaded
        return _functions[key]


# --- host side --------------------------------------------------------------------------------


def _strides(array) -> tuple[int, ...]:
    return tuple(stride // array.itemsize for stride in array.strides)


def _readable(array, name: str):
    """``array`` as the kernels read it: last stride 1, rows 16-byte aligned (else a copy)."""
    import cupy

    assert array.ndim == 4, f"flash attention: {name} must be 4-d, got shape {array.shape}"
    assert array.shape[-1] <= 1 or array.strides[-1] == array.itemsize, (
        f"flash attention: {name}'s last axis must have stride 1, got strides {array.strides}"
    )
    aligned = array.data.ptr % 16 == 0 and all(
        stride % ALIGN_ELEMENTS == 0 for stride in _strides(array)[:3]
    )
    return array if aligned else cupy.ascontiguousarray(array)


def _storage(dtype_name: str):
    return np.uint16 if dtype_name == "bfloat16" else np.float16


def _check(q, k, v, dtype_name: str, bias):
    reason = supports(q.shape[-1], v.shape[-1], dtype_name)
    if reason is not None:
        raise ValueError(f"flash attention: {reason}")
    for name, array in (("q", q), ("k", k), ("v", v)):
        assert array.dtype == _storage(dtype_name), (
            f"flash attention: {name} is {array.dtype}, expected {dtype_name} storage"
        )
    batch, heads, lq, head_dim = q.shape
    _, kv_heads, lk, _ = k.shape
    assert k.shape == (batch, kv_heads, lk, head_dim), f"k {k.shape} does not match q {q.shape}"
    assert v.shape[:3] == (batch, kv_heads, lk), f"v {v.shape} does not match k {k.shape}"
    assert kv_heads > 0 and heads % kv_heads == 0 or heads == 0, (
        f"query heads {heads} are not a multiple of kv heads {kv_heads}"
    )
    if bias is not None:
        assert bias.shape == (batch, heads, lq, lk), (
            f"bias {bias.shape} is not [B, Hq, Lq, Lk] = {(batch, heads, lq, lk)}"
        )
        assert bias.dtype == np.float32, f"bias must be float32, got {bias.dtype}"


def _bias_arguments(bias, dummy):
    if bias is None:
        return [dummy, *(np.int64(0),) * 4]
    return [bias, *(np.int64(stride) for stride in _strides(bias))]


def _stream():
    import cupy

    return cupy.cuda.get_current_stream()


def keep_threshold(p: float) -> int:
    """The 24-bit threshold of dropout's ``u >= p`` on integers: u = bits 2**-24 >= p exactly
    when bits >= ceil(p 2**24) (2**24 at p = 1: nothing is kept)."""
    return math.ceil(p * (1 << 24))


def _dropout_arguments(dropout: float, rng) -> list:
    """The kernels' trailing arguments with dropout: the (seed, offset) int64 pair (device
    memory, read by the kernel), the keep threshold and 1 / (1 - p); none without."""
    if not dropout:
        return []
    from flame.ir.ops.attention import keep_scale

    assert rng is not None and rng.dtype == np.int64 and rng.size == 2, (
        "flash attention: dropout needs the int64 (seed, offset) pair"
    )
    return [rng, np.uint32(keep_threshold(dropout)), np.float32(keep_scale(dropout))]


def forward(q, k, v, *, scale: float, causal: bool, dtype: str, bias=None, dropout: float = 0.0,
            rng=None):  # fmt: skip
    """``(o, lse)``: o [B, Hq, Lq, Dv] in ``dtype``, lse float32 [B, Hq, Lq] (natural log of
    the sum of exp of the scaled, biased scores; -inf where every key is masked). With
    ``dropout`` = p > 0, o is computed from the probabilities dropped by the mask that
    ``rng`` (int64 [2] on the device: seed, offset) draws, the kept ones scaled by 1/(1-p)."""
    import cupy

    _check(q, k, v, dtype, bias)
    batch, heads, lq, head_dim = q.shape
    kv_heads, lk, value_dim = k.shape[1], k.shape[2], v.shape[-1]
    if batch * heads * lq == 0 or lk == 0:
        o = cupy.zeros((batch, heads, lq, value_dim), dtype=_storage(dtype))
        return o, cupy.full((batch, heads, lq), -np.inf, dtype=np.float32)
    # the kernel writes every row of o and lse: no fill (two launches fewer)
    o = cupy.empty((batch, heads, lq, value_dim), dtype=_storage(dtype))
    lse = cupy.empty((batch, heads, lq), dtype=np.float32)
    q, k, v = _readable(q, "q"), _readable(k, "k"), _readable(v, "v")
    if bias is None and not scale > 0:
        # the plain kernel takes the row max of the raw scores, right only for a positive
        # scale; any other goes through the bias variant with a zero bias (every stride 0)
        bias = cupy.broadcast_to(cupy.zeros((1, 1, 1, 1), dtype=np.float32), (batch, heads, lq, lk))
    kernels = _kernels("forward", dtype, head_dim, value_dim, causal, bias is not None,
                       dropout > 0)  # fmt: skip
    fwd, _ = tiles(head_dim, value_dim)
    query_tiles = -(-lq // (16 * fwd.m_tiles * fwd.warps))
    assert query_tiles <= MAX_QUERY_TILES, f"Lq {lq} is too long for one grid column"
    arguments = [
        q, k, v, *_bias_arguments(bias, q)[:1], o, lse,
        np.int32(heads), np.int32(heads // kv_heads), np.int32(lq), np.int32(lk),
        *(np.int64(s) for s in _strides(q)[:3]),
        *(np.int64(s) for s in _strides(k)[:3]),
        *(np.int64(s) for s in _strides(v)[:3]),
        *_bias_arguments(bias, q)[1:],
        np.float32(scale * math.log2(math.e)),
        *_dropout_arguments(dropout, rng),
    ]  # fmt: skip
    kernels["forward"](
        (batch * heads, query_tiles),
        (32 * fwd.warps,),
        tuple(arguments),
        shared_mem=kernels["shared_bytes"],
        stream=_stream(),
    )
    return o, lse


def backward(q, k, v, o, do, lse, *, scale: float, causal: bool, dtype: str, bias=None,
             dropout: float = 0.0, rng=None):  # fmt: skip
    """``(dq, dk, dv)`` of ``forward``'s o for the incoming gradient ``do``, C-contiguous in
    ``dtype``; dk and dv summed over the query heads that share a kv head. ``dropout`` and
    ``rng``: the forward's (the same mask is drawn again)."""
    import cupy

    _check(q, k, v, dtype, bias)
    batch, heads, lq, head_dim = q.shape
    kv_heads, lk, value_dim = k.shape[1], k.shape[2], v.shape[-1]
    storage = _storage(dtype)
    assert o.shape == do.shape == (batch, heads, lq, value_dim), (
        f"o {o.shape} / do {do.shape} are not [B, Hq, Lq, Dv]"
    )
    assert lse.shape == (batch, heads, lq) and lse.dtype == np.float32, "lse: float32 [B, Hq, Lq]"
    assert o.dtype == do.dtype == storage, f"o, do must be {dtype} storage"
    if batch * heads * lq == 0 or lk == 0:  # no query or no key: every gradient is 0
        zeros = [cupy.zeros(array.shape, dtype=storage) for array in (q, k, v)]
        return tuple(zeros)
    # the kernel writes every element of dk and dv; dq comes from its float32 scratch
    dq = cupy.empty(q.shape, dtype=storage)
    dk = cupy.empty(k.shape, dtype=storage)
    dv = cupy.empty(v.shape, dtype=storage)
    q, k, v = _readable(q, "q"), _readable(k, "k"), _readable(v, "v")
    o, do = _readable(o, "o"), _readable(do, "do")
    lse = cupy.ascontiguousarray(lse)
    kernels = _kernels("backward", dtype, head_dim, value_dim, causal, bias is not None,
                       dropout > 0)  # fmt: skip
    _, bwd = tiles(head_dim, value_dim)
    stream = _stream()

    rows = batch * heads * lq
    delta = cupy.empty((batch, heads, lq), dtype=np.float32)
    lse2 = cupy.empty((batch, heads, lq), dtype=np.float32)  # lse log2 e; 0 where -inf
    kernels["delta"](
        (-(-rows // DELTA_WARPS),),
        (32 * DELTA_WARPS,),
        (
            o, do, lse, delta, lse2, np.int32(heads), np.int32(lq), np.int64(rows),
            *(np.int64(s) for s in _strides(o)[:3]),
            *(np.int64(s) for s in _strides(do)[:3]),
        ),
        stream=stream,
    )  # fmt: skip

    dq_acc = cupy.zeros(q.shape, dtype=np.float32)
    if bwd.accumulate_in_registers:
        dk_acc = dv_acc = delta  # unused by the kernel
    else:
        dk_acc = cupy.zeros(k.shape, dtype=np.float32)
        dv_acc = cupy.zeros(v.shape, dtype=np.float32)
    key_tiles = -(-lk // (16 * bwd.warps))
    assert key_tiles <= MAX_QUERY_TILES, f"Lk {lk} is too long for one grid column"
    bias_arguments = _bias_arguments(bias, q)
    arguments = [
        q, k, v, bias_arguments[0], do, lse2, delta, dq_acc, dk, dv, dk_acc, dv_acc,
        np.int32(heads), np.int32(kv_heads), np.int32(heads // kv_heads),
        np.int32(lq), np.int32(lk),
        *(np.int64(s) for s in _strides(q)[:3]),
        *(np.int64(s) for s in _strides(k)[:3]),
        *(np.int64(s) for s in _strides(v)[:3]),
        *(np.int64(s) for s in _strides(do)[:3]),
        *bias_arguments[1:],
        np.float32(scale), np.float32(scale * math.log2(math.e)),
        *_dropout_arguments(dropout, rng),
    ]  # fmt: skip
    kernels["backward"](
        (batch * kv_heads, key_tiles),
        (32 * bwd.warps,),
        tuple(arguments),
        shared_mem=kernels["shared_bytes"],
        stream=stream,
    )
    from flame.runtime.device import device_info

    total = dq.size
    blocks = max(1, min(-(-total // CONVERT_BLOCK), device_info().multiprocessors * 32))
    kernels["convert"]((blocks,), (CONVERT_BLOCK,), (dq_acc, dq, np.int64(total)), stream=stream)
    return dq, dk, dv
