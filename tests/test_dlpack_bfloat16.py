"""bfloat16 through DLPack: the capsule relabelling (CPU tier, with NumPy and PyTorch on the
CPU), and zero-copy exchange with PyTorch on the GPU (gpu tier)."""

from __future__ import annotations

import numpy as np
import pytest

import flame as fl
from flame.runtime.dlpack import K_DL_BFLOAT, K_DL_UINT, CapsuleSource, capsule_dtype, relabel

torch = pytest.importorskip("torch")
ml_dtypes = pytest.importorskip("ml_dtypes")


def test_relabel_uint16_capsule_as_bfloat16_for_torch(rng):
    values = rng.standard_normal(7).astype(ml_dtypes.bfloat16)
    bits = values.view(np.uint16)
    capsule = bits.__dlpack__()
    assert capsule_dtype(capsule) == (K_DL_UINT, 16, 1)
    relabel(capsule, K_DL_BFLOAT, 16)
    assert capsule_dtype(capsule) == (K_DL_BFLOAT, 16, 1)
    tensor = torch.from_dlpack(CapsuleSource(capsule, (1, 0)))
    assert tensor.dtype == torch.bfloat16
    np.testing.assert_array_equal(tensor.float().numpy(), values.astype(np.float32))
    assert tensor.data_ptr() == bits.ctypes.data  # the same memory


def test_relabel_torch_bfloat16_capsule_for_numpy():
    tensor = torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16)
    capsule = tensor.__dlpack__()
    assert capsule_dtype(capsule) == (K_DL_BFLOAT, 16, 1)
    bits = np.from_dlpack(CapsuleSource(relabel(capsule, K_DL_UINT, 16), (1, 0)))
    assert bits.dtype == np.uint16
    np.testing.assert_array_equal(bits.view(ml_dtypes.bfloat16).astype(np.float32), [1.5, -2, 3.25])


def test_relabel_refuses_other_widths_and_used_capsules():
    capsule = np.zeros(3, np.float32).__dlpack__()
    with pytest.raises(BufferError, match="32-bit"):
        relabel(capsule, K_DL_BFLOAT, 16)
    source = CapsuleSource(np.zeros(2, np.uint16).__dlpack__(), (1, 0))
    np.from_dlpack(source)
    with pytest.raises(BufferError, match="already consumed"):
        source.__dlpack__()


@pytest.mark.gpu
def test_bfloat16_to_torch_and_back_without_copies(rng):
    x = fl.tensor(rng.standard_normal((4, 5)).astype(np.float32)).to(fl.bfloat16).realize()
    t = torch.from_dlpack(x)
    assert t.dtype == torch.bfloat16 and t.is_cuda and t.data_ptr() == x.data_ptr()
    np.testing.assert_array_equal(t.float().cpu().numpy(), x.float().numpy())
    source = torch.randn(3, 6, device="cuda").bfloat16()
    y = fl.from_dlpack(source)
    assert y.dtype == fl.bfloat16 and y.data_ptr() == source.data_ptr()
    np.testing.assert_array_equal(y.float().numpy(), source.float().cpu().numpy())
    with pytest.raises(AttributeError, match="no bfloat16 type; use DLPack"):
        x.__cuda_array_interface__  # noqa: B018
