"""``multi_head_attention_forward`` with ``static_k``/``static_v`` (keys and values given by
head, in place of the projections), against PyTorch: values and gradients, with and without
the weights, a key padding mask over the static keys, a zero key, and PyTorch's errors."""

from __future__ import annotations

import numpy as np
import pytest
from gradcheck import check_against_torch

import flame as fl
from flame.nn import multihead_attention

TARGET, SOURCE, STATIC, BATCH, EMBED, HEADS = 5, 6, 7, 3, 8, 2
HEAD_DIM = EMBED // HEADS


def torch_module():
    return pytest.importorskip("torch", reason="PyTorch is the reference for these checks")


def _random(rng, *shape) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def _arrays(rng, static_k: bool, static_v: bool):
    shapes = [(TARGET, BATCH, EMBED), (SOURCE, BATCH, EMBED), (SOURCE, BATCH, EMBED),
              (3 * EMBED, EMBED), (3 * EMBED,), (EMBED, EMBED), (EMBED,)]  # fmt: skip
    shapes += [(BATCH * HEADS, STATIC, HEAD_DIM)] * (static_k + static_v)
    return [_random(rng, *shape) for shape in shapes]


CASES = [
    ("k-and-v", True, True, {}),
    ("k-and-v-no-weights", True, True, {"need_weights": False}),
    ("k-only-zero-attn", True, False, {"add_zero_attn": True}),
    ("v-only", False, True, {}),
    ("k-and-v-padding", True, True, {"padding": True}),
]


@pytest.mark.parametrize("case", CASES, ids=lambda case: case[0])
def test_static_keys_and_values_match_torch(case, rng):
    torch = torch_module()
    _, static_k, static_v, options = case
    options = dict(options)
    padding = None
    if options.pop("padding", False):
        padding = rng.random((BATCH, STATIC)) > 0.6
        padding[:, 0] = False
    zero = options.pop("add_zero_attn", False)
    arrays = _arrays(rng, static_k, static_v)
    if not (static_k and static_v):  # projected keys or values: as long as the static ones
        arrays[1], arrays[2] = (_random(rng, STATIC, BATCH, EMBED) for _ in range(2))

    def run(module, convert, q, k, v, w, b, ow, ob, *static):
        given = list(static)
        keys = given.pop(0) if static_k else None
        values = given.pop(0) if static_v else None
        mask = None if padding is None else convert(padding)
        output, weights = module(
            q, k, v, EMBED, HEADS, w, b, None, None, zero, 0.0, ow, ob,
            key_padding_mask=mask, static_k=keys, static_v=values, **options,
        )  # fmt: skip
        return output if weights is None else (output, weights)

    unused = {1} if static_k else set()  # projected, then replaced by the static ones
    unused |= {2} if static_v else set()
    positions = [index for index in range(len(arrays)) if index not in unused]
    weighing = [0, 1, 3, 4, 7] if static_k else [0, 1, 3, 4]  # what the weights depend on
    for pick in (0, 1):
        if pick and options.get("need_weights") is False:
            continue
        check_against_torch(
            lambda *values, pick=pick: _pick(
                run(multihead_attention.multi_head_attention_forward, fl.from_numpy, *values),
                pick,
            ),
            lambda *values, pick=pick: _pick(
                run(torch.nn.functional.multi_head_attention_forward, torch.from_numpy, *values),
                pick,
            ),
            arrays, [p for p in (weighing if pick else positions) if p not in unused], rng,
            atol=1e-4,
        )  # fmt: skip


def _pick(result, index):
    return result[index] if isinstance(result, tuple) else result


def _call(arrays, **overrides):
    q, k, v, w, b, ow, ob = (fl.from_numpy(array) for array in arrays[:7])
    arguments = dict(bias_k=None, bias_v=None, static_k=None, static_v=None)
    arguments.update(overrides)
    return multihead_attention.multi_head_attention_forward(
        q, k, v, EMBED, HEADS, w, b, arguments["bias_k"], arguments["bias_v"], False, 0.0,
        ow, ob, static_k=arguments["static_k"], static_v=arguments["static_v"],
    )  # fmt: skip


@pytest.mark.parametrize(
    "shape, message",
    [((BATCH, STATIC, HEAD_DIM), "static_k.size\\(0\\) of 6, but got 3"),
     ((BATCH * HEADS, STATIC, HEAD_DIM + 1), "static_k.size\\(2\\) of 4, but got 5")],
)  # fmt: skip
def test_static_keys_of_the_wrong_shape_are_refused(shape, message, rng):
    with fl.backend("reference"), pytest.raises(AssertionError, match=message):
        _call(_arrays(rng, False, False), static_k=fl.from_numpy(_random(rng, *shape)))


def test_a_key_bias_with_static_keys_is_refused(rng):
    static = fl.from_numpy(_random(rng, BATCH * HEADS, STATIC, HEAD_DIM))
    bias = fl.from_numpy(_random(rng, 1, 1, EMBED))
    with fl.backend("reference"), pytest.raises(AssertionError, match="static key"):
        _call(_arrays(rng, False, False), bias_k=bias, bias_v=bias, static_k=static)
