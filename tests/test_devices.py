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


def test_creation_functions_take_device_and_requires_grad():
    made = [
        fl.zeros(2, 3, device="cpu", requires_grad=True),
        fl.ones(2, device="cpu", requires_grad=True),
        fl.full((2,), 1.5, device="cpu", requires_grad=True),
        fl.tensor([1.0, 2.0], device="cpu", requires_grad=True),
        fl.arange(0.0, 3.0, device="cpu", requires_grad=True),
        fl.rand(2, device="cpu", requires_grad=True),
        fl.randn(2, device="cpu", requires_grad=True),
        fl.linspace(0, 1, 4, device="cpu", requires_grad=True),
        fl.eye(2, device="cpu", requires_grad=True),
        fl.empty(3, device="cpu", requires_grad=True),
    ]
    for tensor in made:
        assert tensor.device == "cpu" and tensor.requires_grad
    with fl.backend("reference"):
        source = fl.ones(2)
    for like in (fl.zeros_like, fl.ones_like, fl.rand_like, fl.randn_like, fl.empty_like):
        assert like(source).device == "cpu"  # the input's device, whatever the current one
    with pytest.raises(fl.GradError, match="only float tensors"):
        fl.randint(0, 3, (2,), device="cpu", requires_grad=True)
    total = (made[0] * 2).sum()
    total.backward()
    np.testing.assert_array_equal(made[0].grad.numpy(), np.full((2, 3), 2.0, np.float32))
