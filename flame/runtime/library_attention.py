"""``attention`` and ``attention_backward`` on the GPU (see flame/ir/ops/attention.py for the
packed results: O then the rows' float32 log-sum-exp; dQ, dK, dV).

cuDNN's fused attention (``sdpa`` / ``sdpa_backward`` of its graph API, flash class: the
scores stay on chip) runs them where cuDNN is usable and accepts the configuration; plans are
cached per configuration by ``library_cudnn``. Where cuDNN is absent, disabled
(``flame.backends.cudnn.enabled = False``) or refuses a configuration, FLAME's own
flash-attention kernel runs them (``flame/runtime/flash_attention.py``). Either way memory is
linear in the sequence length.

Inputs are read in place (any strides with a unit stride on the head dim: ``[B, L, H, D]``
memory seen as ``[B, H, L, D]`` needs no copy). A bias whose query or key axis is broadcast
is expanded on those axes first (cuDNN broadcasts only batch and heads).

Dropout (``dropout`` > 0): the last input is the (seed, offset) int64 pair of FLAME's
generator, read from device memory by the kernels (so compiled programs and CUDA graphs draw
a new mask at every call). FLAME's flash kernels draw the reference's mask
(``flame.ir.ops.attention.dropout_keep``) bit for bit; cuDNN draws its own (its Philox stream,
keyed by the same seed and offset, read through int64 [1, 1, 1, 1] device tensors). The
forward and the backward of one attention must draw the same mask, so they take the same
path: cuDNN runs a forward with dropout only once the backward's plan for it has built too
(the backward reads dO contiguous, so its plan is known at the forward), and the backward
takes FLAME's kernel exactly where the forward's configuration was refused.
"""

from __future__ import annotations

import functools
import warnings

import numpy as np

from flame.ir.node import Node
from flame.ir.ops.attention import output_count
from flame.runtime import library_cudnn as dnn
from flame.runtime.library import implements
from flame.runtime.library_scan import _widened

Q, K, V, BIAS, O, STATS, DO, DQ, DK, DV, SEED, OFFSET = range(1, 13)  # noqa: E741 (plan uids)
_REFUSED: dict[tuple, str] = {}  # configurations cuDNN refused, with its reason


class CudnnFallbackWarning(RuntimeWarning):
    """cuDNN refused an attention configuration; FLAME's own kernel computes it (once per
    configuration and process)."""


def describe(node: Node) -> str:
    shapes = ", ".join(f"{child.dtype.name}{list(child.shape)}" for child in node.inputs[:3])
    extra = ", bias" if _has_bias(node) else ""
    if _dropout(node):
        extra += f", dropout={_dropout(node):.6g}"
    return (
        f"{node.op}({shapes}{extra}, scale={node.attr('scale'):.6g}, causal={node.attr('causal')})"
    )


def _dropout(node: Node) -> float:
    return float(node.attr("dropout", 0.0) or 0.0)


def _has_bias(node: Node) -> bool:
    count = len(node.inputs) - (1 if _dropout(node) else 0)
    return count == (4 if node.op == "attention" else 6)


def _rng_split(node: Node, arrays: list) -> tuple[list, object]:
    """(the other inputs, the (seed, offset) int64 pair or None)."""
    if not _dropout(node):
        return arrays, None
    import cupy

    return arrays[:-1], cupy.ascontiguousarray(arrays[-1])


def _bits(array, dtype_name: str):
    """bfloat16 as uint16 bits, FLAME's storage (a buffer imported through DLPack may carry
    CuPy's own bfloat16 dtype)."""
    if dtype_name == "bfloat16" and array.dtype != np.uint16:
        return array.view(np.uint16)
    return array


def _unit_last(array):
    import cupy

    if array.shape[-1] > 1 and array.strides[-1] != array.itemsize:
        return cupy.ascontiguousarray(array)
    return array


def _bias_for_cudnn(bias, target):
    """The bias as cuDNN reads it (it broadcasts batch and heads only), or None where that
    would take a copy of [Lq, Lk] size: a key-padding mask [B, 1, 1, Lk] goes to FLAME's
    flash kernel, which reads it broadcast, so memory stays linear in the lengths."""
    import cupy

    if bias.shape[2:] != tuple(target[2:]):
        return None
    if min(bias.strides[2:]) <= 0 or bias.strides[-1] != bias.itemsize:
        bias = cupy.ascontiguousarray(bias)
    return bias


def _contiguous_strides(shape) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return strides[::-1]


def _element_strides(array) -> list[int]:
    return [
        stride // array.itemsize if size > 1 else 1
        for stride, size in zip(array.strides, array.shape)
    ]


def _dropout_key(node) -> tuple:
    """What dropout adds to a plan's key (nothing without: the plans of before)."""
    return (("dropout", _dropout(node)),) if _dropout(node) else ()


def _dropout_option(graph, node, options: dict) -> None:
    """cuDNN's dropout: the probability (compiled into the plan) and the seed and offset as
    int64 device tensors, read when the plan runs (FLAME's generator pair)."""
    if not _dropout(node):
        return
    made = []
    for uid, name in ((SEED, "seed"), (OFFSET, "offset")):
        tensor = graph.tensor(
            name=name, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=dnn.data_type("int64")
        )
        tensor.set_uid(uid)
        made.append(tensor)
    options["dropout"] = (_dropout(node), *made)


def _dropout_pointers(pointers: dict, rng) -> None:
    if rng is not None:  # (seed, offset): two int64 of one contiguous pair
        pointers[SEED] = rng.data.ptr
        pointers[OFFSET] = rng.data.ptr + rng.itemsize


def _cudnn_forward(node, q, k, v, bias, packed, rng=None) -> None:
    dtype = node.dtype.name
    o_shape = (*q.shape[:3], v.shape[3])
    scale, causal = float(node.attr("scale")), bool(node.attr("causal"))
    arrays = [(Q, q), (K, k), (V, v)] + ([(BIAS, bias)] if bias is not None else [])
    key = ("sdpa", dtype, scale, causal) + tuple(
        (uid, tuple(array.shape), tuple(_element_strides(array))) for uid, array in arrays
    )
    key += _dropout_key(node)
    label = functools.partial(describe, node)  # formatted only for an error
    if rng is not None:  # the backward must draw this mask again: its plan must build too
        out = packed[: output_count(q.shape, v.shape)].reshape(o_shape)
        _backward_plan(node, q, k, v, bias, out, out)

    def define(graph):
        made = {
            uid: dnn.tensor(graph, uid, f"t{uid}", array, dtype, strides=_element_strides(array))
            for uid, array in arrays
        }
        options = {"attn_scale": scale, "use_causal_mask": causal}
        if BIAS in made:
            options["bias"] = made[BIAS]
        _dropout_option(graph, node, options)
        try:
            out, stats = graph.sdpa(q=made[Q], k=made[K], v=made[V], generate_stats=True, **options)
        except TypeError:  # frontends before generate_stats spell it is_inference
            out, stats = graph.sdpa(q=made[Q], k=made[K], v=made[V], is_inference=False, **options)
        out.set_output(True).set_dim(list(o_shape)).set_stride(_contiguous_strides(o_shape))
        out.set_data_type(dnn.data_type(dtype)).set_uid(O)
        stats.set_output(True).set_dim([*q.shape[:3], 1]).set_stride(
            [*_contiguous_strides(q.shape[:3]), 1]
        )
        stats.set_data_type(dnn.data_type("float32")).set_uid(STATS)

    made = dnn.plan(key, dtype, define, label)
    base = packed.data.ptr
    pointers = {uid: array.data.ptr for uid, array in arrays}
    pointers[O] = base
    pointers[STATS] = base + output_count(q.shape, v.shape) * packed.itemsize
    _dropout_pointers(pointers, rng)
    dnn.execute(made, pointers, label)


def _backward_plan(node, q, k, v, bias, out, d_out):
    """(the plan of ``sdpa_backward`` for these arrays' shapes and strides, the arrays by
    uid); ``node``'s dtype and attributes (the forward's and the backward's agree)."""
    dtype = node.dtype.name
    scale, causal = float(node.attr("scale")), bool(node.attr("causal"))
    arrays = [(Q, q), (K, k), (V, v), (O, out), (DO, d_out)]
    arrays += [(BIAS, bias)] if bias is not None else []
    key = ("sdpa_backward", dtype, scale, causal) + tuple(
        (uid, tuple(array.shape), tuple(_element_strides(array))) for uid, array in arrays
    )
    key += _dropout_key(node)
    label = functools.partial(describe, node)  # formatted only for an error
    shapes = {DQ: q.shape, DK: k.shape, DV: v.shape}

    def define(graph):
        made = {
            uid: dnn.tensor(graph, uid, f"t{uid}", array, dtype, strides=_element_strides(array))
            for uid, array in arrays
        }
        stats = graph.tensor(
            name="stats", dim=[*q.shape[:3], 1], stride=[*_contiguous_strides(q.shape[:3]), 1],
            data_type=dnn.data_type("float32"),
        )  # fmt: skip
        stats.set_uid(STATS)
        options = {"attn_scale": scale, "use_causal_mask": causal}
        if BIAS in made:
            options["bias"] = made[BIAS]
        _dropout_option(graph, node, options)
        results = graph.sdpa_backward(
            q=made[Q], k=made[K], v=made[V], o=made[O], dO=made[DO], stats=stats, **options
        )
        for uid, result in zip((DQ, DK, DV), results):
            shape = shapes[uid]
            result.set_output(True).set_dim(list(shape)).set_stride(_contiguous_strides(shape))
            result.set_data_type(dnn.data_type(dtype)).set_uid(uid)

    return dnn.plan(key, dtype, define, label), arrays


def _cudnn_backward(node, q, k, v, bias, out, stats_pointer, d_out, grads, rng=None) -> None:
    made, arrays = _backward_plan(node, q, k, v, bias, out, d_out)
    shapes = {DQ: q.shape, DK: k.shape, DV: v.shape}
    pointers = {uid: array.data.ptr for uid, array in arrays}
    pointers[STATS] = stats_pointer
    _dropout_pointers(pointers, rng)
    offset = grads.data.ptr
    for uid in (DQ, DK, DV):
        pointers[uid] = offset
        offset += int(np.prod(shapes[uid])) * grads.itemsize
    dnn.execute(made, pointers, functools.partial(describe, node))


def _try_cudnn(node, run) -> bool:
    """Run ``run()`` through cuDNN when it is usable; False where cuDNN refused (remembered
    per configuration, so a refused one is not rebuilt on every call)."""
    if not dnn.usable():
        return False
    key = dnn.configuration(node)
    if key in _REFUSED:
        return False
    try:
        run()
    except dnn.CudnnError as error:
        if "refused" not in str(error):
            raise
        _REFUSED[key] = str(error)
        warnings.warn(
            f"{error}; FLAME's flash-attention kernel runs it instead", CudnnFallbackWarning,
            stacklevel=2,
        )  # fmt: skip
        return False
    return True


def _cudnn_takes(node, bias, cudnn_bias) -> bool:
    """Whether cuDNN may take the call at all (forward and backward decide alike): a bias it
    can read, and dropout below 1 (p = 1 would scale by 1 / 0; FLAME's kernel gives 0)."""
    return (bias is None or cudnn_bias is not None) and _dropout(node) < 1.0


def _forward_refused(node) -> bool:
    """Whether cuDNN refused the configuration of the forward whose packed result the
    backward ``node`` reads (so FLAME's kernel drew its dropout mask)."""
    forward = node.inputs[3]
    return forward.op == "attention" and dnn.configuration(forward) in _REFUSED


def _flash():
    from flame.runtime import flash_attention

    return flash_attention


def _flash_bias(bias, node, target):
    import cupy

    if bias is None:
        return None
    return cupy.broadcast_to(_widened(bias, node.dtype.name).astype(np.float32), target)


def _check_flash(node, q, v) -> None:
    reason = _flash().supports(q.shape[-1], v.shape[-1], node.dtype.name)
    if reason is not None:
        refused = _REFUSED.get(
            dnn.configuration(node), "cuDNN is not in use: " + dnn.status().reason
        )
        raise RuntimeError(f"{describe(node)}: no attention kernel takes it ({refused}; {reason})")


@implements("attention")
def attention(node: Node, arrays: list):
    import cupy

    arrays, rng = _rng_split(node, arrays)
    arrays = [_bits(array, node.dtype.name) for array in arrays]
    q, k, v = (_unit_last(array) for array in arrays[:3])
    bias = arrays[3] if len(arrays) > 3 else None
    packed = cupy.empty(
        node.shape, dtype=np.uint16 if node.dtype.name == "bfloat16" else node.dtype.numpy
    )
    count = output_count(q.shape, v.shape)
    if packed.size == 0 or q.size == 0:
        return packed
    if k.shape[2] == 0:  # no keys: every row is empty
        packed[:count] = 0
        packed[count:].view(np.float32)[...] = -np.inf
        return packed
    scores_shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    cudnn_bias = _bias_for_cudnn(bias, scores_shape) if bias is not None else None
    run = lambda: _cudnn_forward(node, q, k, v, cudnn_bias, packed, rng)  # noqa: E731
    if _cudnn_takes(node, bias, cudnn_bias) and _try_cudnn(node, run):
        return packed
    _check_flash(node, q, v)
    out, lse = _flash().forward(
        q, k, v, scale=float(node.attr("scale")), causal=bool(node.attr("causal")),
        bias=_flash_bias(bias, node, scores_shape), dtype=node.dtype.name,
        dropout=_dropout(node), rng=rng,
    )  # fmt: skip
    packed[:count] = out.reshape(-1)
    packed[count:].view(np.float32)[...] = lse.reshape(-1)
    return packed


@implements("attention_backward")
def attention_backward(node: Node, arrays: list):
    import cupy

    arrays, rng = _rng_split(node, arrays)
    arrays = [_bits(array, node.dtype.name) for array in arrays]
    q, k, v = (_unit_last(array) for array in arrays[:3])
    packed, d_out = arrays[3], _unit_last(arrays[4])
    bias = arrays[5] if len(arrays) > 5 else None
    grads = cupy.empty(
        node.shape, dtype=np.uint16 if node.dtype.name == "bfloat16" else node.dtype.numpy
    )
    if grads.size == 0:
        return grads
    count = output_count(q.shape, v.shape)
    o_shape = (*q.shape[:3], v.shape[3])
    out = packed[:count].reshape(o_shape)
    if q.size == 0 or k.shape[2] == 0:
        grads[...] = 0
        return grads
    stats = packed[count:]
    scores_shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    cudnn_bias = _bias_for_cudnn(bias, scores_shape) if bias is not None else None
    cudnn_takes = _cudnn_takes(node, bias, cudnn_bias)
    if rng is not None:  # the forward's path: its mask is drawn again
        if cudnn_takes and dnn.usable() and not _forward_refused(node):
            d_out = cupy.ascontiguousarray(d_out)  # the layout the forward built the plan for
            try:
                _cudnn_backward(node, q, k, v, cudnn_bias, out, stats.data.ptr, d_out, grads, rng)
            except dnn.CudnnError as error:
                raise RuntimeError(
                    f"{error} (cuDNN drew this attention's dropout mask in the forward, so "
                    "FLAME's kernel, whose mask differs, cannot compute the backward)"
                ) from None
            return grads
    elif cudnn_takes and _try_cudnn(
        node,
        lambda: _cudnn_backward(node, q, k, v, cudnn_bias, out, stats.data.ptr, d_out, grads),
    ):
        return grads
    _check_flash(node, q, v)
    lse = stats.view(np.float32).reshape(q.shape[:3])
    d_q, d_k, d_v = _flash().backward(
        q, k, v, out, d_out, lse, scale=float(node.attr("scale")),
        causal=bool(node.attr("causal")), bias=_flash_bias(bias, node, scores_shape),
        dtype=node.dtype.name, dropout=_dropout(node), rng=rng,
    )  # fmt: skip
    start = 0
    for part in (d_q, d_k, d_v):
        grads[start : start + part.size] = part.reshape(-1)
        start += part.size
    return grads
