"""Out-of-range indices found by GPU kernels, raised at the host's next read
(flame/runtime/device_errors.py), and nll_loss/cross_entropy's target check (check_index).

CPU tier: the reference refuses as PyTorch does, the word's encoding and decoding, the
check kernels compile. gpu tier: a bad target or index inside a lazy graph, a compiled
function and a captured CUDA graph raises at the next read, naming the op and the user's
line; the error is raised once and the next good call reads clean.
"""

from __future__ import annotations

import numpy as np
import pytest

import flame as fl
import flame.nn.functional as F
from flame.runtime import device_errors

try:
    import torch
except ImportError:  # the CPU tier runs without PyTorch too
    torch = None


def logits_and_targets(rng, rows=6, classes=5, bad=None):
    logits = rng.standard_normal((rows, classes)).astype(np.float32)
    targets = rng.integers(0, classes, rows)
    if bad is not None:
        targets[rows // 2] = bad
    return logits, targets


@pytest.mark.parametrize("loss", ["cross_entropy", "nll_loss"])
@pytest.mark.parametrize("bad", [5, 9, -3])
def test_bad_target_raises_index_error_naming_it(loss, bad, backend, rng):
    logits, targets = logits_and_targets(rng, bad=bad)
    value = getattr(F, loss)(fl.tensor(logits).log_softmax(1), fl.tensor(targets))
    with pytest.raises(IndexError, match=f"Target {bad} is out of bounds") as error:
        value.item()
    assert "test_device_errors.py" in str(error.value)


@pytest.mark.parametrize("loss", ["cross_entropy", "nll_loss"])
def test_only_the_ignored_index_may_lie_outside_the_classes(loss, backend, rng):
    logits, targets = logits_and_targets(rng)
    targets[1], targets[2] = -100, 7  # -100 is not ignored when ignore_index is 7
    with pytest.raises(IndexError, match="Target -100 is out of bounds"):
        getattr(F, loss)(fl.tensor(logits), fl.tensor(targets), ignore_index=7).numpy()
    targets[1] = 7
    got = getattr(F, loss)(fl.tensor(logits), fl.tensor(targets), ignore_index=7).numpy()
    kept = np.flatnonzero(targets != 7)
    picked = logits[kept, targets[kept]]
    if loss == "cross_entropy":
        picked = picked - np.log(np.exp(logits[kept]).sum(1))
    np.testing.assert_allclose(got, -picked.mean(), rtol=1e-5)
    if torch is not None:
        expected = getattr(torch.nn.functional, loss)(
            torch.tensor(logits), torch.tensor(targets), ignore_index=7
        )
        np.testing.assert_allclose(got, expected.numpy(), rtol=1e-5)


def test_float_target_is_refused_at_the_call_naming_the_op():
    with pytest.raises(TypeError, match="nll_loss: target must hold int32 or int64"):
        F.nll_loss(fl.zeros(3, 4), fl.tensor(np.array([0, 1, 2], dtype=np.int16)))


@pytest.mark.parametrize("include_self", [True, False])
def test_integer_scatter_reduce_prod_is_exact(include_self, backend):
    data = np.array([[3, -2, 0, 5], [1, 7, -1, 2]], dtype=np.int64)
    index = np.array([[0, 0, 1], [3, 3, 3]])
    src = np.array([[-4, 6, 0], [2, -3, 11]], dtype=np.int64)
    got = fl.scatter_reduce(fl.tensor(data), 1, fl.tensor(index), fl.tensor(src), "prod",
                            include_self=include_self).numpy()  # fmt: skip
    expected = data.copy()
    if not include_self:
        expected[[0, 0, 1], [0, 1, 3]] = 1
    np.multiply.at(expected, (np.array([[0, 0, 0], [1, 1, 1]]), index), src)
    np.testing.assert_array_equal(got, expected)
    assert got.dtype == np.int64


# --- the word ---------------------------------------------------------------------------------


def test_value_bits_decode_negative_and_large_indices():
    for value in (0, 5, -1, -100, 2**40, -(2**40)):
        bits = (3 << device_errors.VALUE_BITS) | (value & ((1 << device_errors.VALUE_BITS) - 1))
        assert bits >> device_errors.VALUE_BITS == 3
        assert device_errors._value(bits) == value


def test_site_codes_are_stable_and_distinct():
    first = device_errors.site_code("gather", "index {value} in dim 0", ("a.py", 3))
    again = device_errors.site_code("gather", "index {value} in dim 0", ("a.py", 3))
    other = device_errors.site_code("gather", "index {value} in dim 0", ("a.py", 4))
    assert first == again != other
    assert 0 < first < 1 << 15 and 0 < other < 1 << 15


def test_a_recorded_error_is_raised_once_with_its_site(monkeypatch):
    message = "embedding: index {value} is out of range"
    code = device_errors.site_code("embedding", message, ("m.py", 12))
    host = np.zeros(1, dtype=np.int64)
    monkeypatch.setattr(device_errors, "_word", (None, host, 0))
    device_errors.raise_pending()  # nothing recorded: no error
    host[0] = (code << device_errors.VALUE_BITS) | (-7 & ((1 << device_errors.VALUE_BITS) - 1))
    with pytest.raises(IndexError, match=r"embedding: index -7 is out of range .*m\.py:12"):
        device_errors.raise_pending()
    assert host[0] == 0
    device_errors.raise_pending()  # cleared: raised once


def test_check_kernel_and_reporting_gather_compile(nvrtc):
    from flame.runtime import indexing_kernels
    from flame.runtime.compiler import nvrtc_compile

    for source in (
        indexing_kernels.check_source("check", "int64"),
        indexing_kernels.gather_source("gather", 2, 4, "int32", "int"),
        indexing_kernels.scatter_add_source("scatter_add", 1, "bfloat16", "int64", "long long"),
    ):
        assert "flame_report(errors, site" in source
        assert nvrtc_compile(source, source.split("void ")[1].split("(")[0], "sm_90")


# --- the GPU ----------------------------------------------------------------------------------


def _loss_step(logits, targets):
    return F.cross_entropy(logits * 2.0, targets)


@pytest.mark.gpu
@pytest.mark.parametrize("graphed", [False, True])
def test_gpu_compiled_and_captured_steps_report_a_bad_target(graphed, cuda_backend, rng):
    step = fl.compile(_loss_step, cuda_graph=graphed)
    logits, targets = logits_and_targets(rng)
    good = step(fl.tensor(logits), fl.tensor(targets)).item()
    bad_targets = targets.copy()
    bad_targets[0] = 11
    loss = step(fl.tensor(logits), fl.tensor(bad_targets))
    with pytest.raises(IndexError, match="Target 11 is out of bounds") as error:
        loss.item()
    assert "test_device_errors.py" in str(error.value)
    assert step(fl.tensor(logits), fl.tensor(targets)).item() == pytest.approx(good)


@pytest.mark.gpu
def test_gpu_error_is_raised_by_synchronize_too(cuda_backend):
    picked = fl.index_select(fl.arange(6.0), 0, fl.tensor([1, 8]))
    picked.realize()  # queued, not read
    with pytest.raises(IndexError, match="index_select: index 8"):
        fl.synchronize()
    np.testing.assert_array_equal(picked.numpy(), [1.0, 0.0])  # raised once
