"""Devices as PyTorch names them (issue 18): x.device, to(device / dtype / other), cpu(),
cuda(); FLAME's reference backend is the cpu device."""

from __future__ import annotations

import numpy as np
import pytest

import flame as fl


def test_device_names_and_to_forms():
    with fl.backend("reference"):
        x = fl.tensor(np.arange(3, dtype=np.float32))
        assert x.device == "cpu" and x.device == fl.device("cpu") and not x.is_cuda
        assert str(fl.device("cuda:0")) == "cuda:0" and fl.device("cuda").index == 0
        assert x.to(fl.float16).dtype is fl.float16
        assert x.to("cpu", fl.int32).dtype is fl.int32
        assert x.to(dtype=fl.bfloat16, device="cpu").dtype is fl.bfloat16
        assert x.to(fl.tensor(np.zeros(1, np.int64))).dtype is fl.int64
        assert x.to("cpu") is x and x.cpu() is x
        assert x.to(fl.float32, copy=True) is not x
        with pytest.raises(ValueError, match="unknown device"):
            fl.device("mps")
        with pytest.raises(TypeError, match="unexpected keyword"):
            x.to(fl.float16, memory_format=None)


@pytest.mark.gpu
def test_moving_between_the_gpu_and_the_cpu_copies_values():
    with fl.backend("reference"):
        x = fl.tensor(np.arange(6, dtype=np.float32).reshape(2, 3))
    on_gpu = x.cuda()
    assert on_gpu.device == "cuda:0" and on_gpu.is_cuda
    back = (on_gpu * 2).to("cpu")
    assert back.device == "cpu"
    np.testing.assert_array_equal(back.numpy(), x.numpy() * 2)
