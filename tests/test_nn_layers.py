"""Layer modules (issue 19): Linear, Bilinear, Identity, Conv1d/2d, ConvTranspose1d/2d,
LayerNorm, GroupNorm, RMSNorm, BatchNorm1d/2d and Embedding against PyTorch's.

One table of layer configurations drives the properties: ``state_dict`` keys, shapes and
dtypes and ``repr`` equal PyTorch's; forward values and every gradient (input and
parameters) equal PyTorch's once PyTorch's weights are loaded through a safetensors file;
default initialisation follows PyTorch's distributions; BatchNorm's running statistics
follow PyTorch's through training steps; the GPU gives the reference backend's numbers.

Tests that compare with PyTorch import it themselves; the rest run without it."""

from __future__ import annotations

import math

import numpy as np
import pytest

import flame as fl
from flame.nn.modules.batchnorm import BatchNorm1d, BatchNorm2d
from flame.nn.modules.conv import Conv1d, Conv2d, ConvTranspose1d, ConvTranspose2d
from flame.nn.modules.linear import Bilinear, Identity, Linear
from flame.nn.modules.normalization import GroupNorm, LayerNorm, RMSNorm
from flame.nn.modules.sparse import Embedding

LAYERS = {
    layer.__name__: layer
    for layer in (
        BatchNorm1d, BatchNorm2d, Bilinear, Conv1d, Conv2d, ConvTranspose1d, ConvTranspose2d,
        Embedding, GroupNorm, Identity, LayerNorm, Linear, RMSNorm,
    )
}  # fmt: skip


class Case:
    """One layer configuration: ``name(*args, **kwargs)`` called on inputs of ``shapes``
    (``indices``: int64 indices below ``indices`` instead of floats), with ``forward``'s
    keyword arguments."""

    def __init__(self, id, name, args, kwargs, shapes, indices=None, forward=None):  # noqa: A002
        self.id, self.name, self.args, self.kwargs = id, name, args, kwargs
        self.shapes, self.indices, self.forward = shapes, indices, forward or {}

    def make(self, library):
        layer = getattr(library.nn, self.name) if library is not None else LAYERS[self.name]
        return layer(*self.args, **self.kwargs)

    def inputs(self, rng) -> list[np.ndarray]:
        if self.indices is not None:
            return [rng.integers(0, self.indices, shape).astype(np.int64) for shape in self.shapes]
        return [rng.standard_normal(shape).astype(np.float32) for shape in self.shapes]


CASES = [
    Case("Identity", "Identity", (3,), {"unused": 1}, [(2, 3)]),
    Case("Linear", "Linear", (4, 3), {}, [(2, 4)]),
    Case("Linear-nobias-3d", "Linear", (4, 3), {"bias": False}, [(2, 5, 4)]),
    Case("Bilinear", "Bilinear", (3, 4, 2), {}, [(5, 3), (5, 4)]),
    Case("Bilinear-nobias", "Bilinear", (2, 3, 4), {"bias": False}, [(2, 2), (2, 3)]),
    Case("Conv1d", "Conv1d", (2, 4, 3), {}, [(2, 2, 7)]),
    Case("Conv1d-circular", "Conv1d", (4, 4, 3),
         {"stride": 2, "padding": 1, "groups": 2, "padding_mode": "circular"}, [(2, 4, 8)]),
    Case("Conv1d-same-dilated", "Conv1d", (2, 3, 2),
         {"padding": "same", "dilation": 2, "bias": False}, [(2, 2, 6)]),
    Case("Conv1d-unbatched", "Conv1d", (2, 3, 3), {"padding": 2}, [(2, 5)]),
    Case("Conv2d", "Conv2d", (3, 4, 3), {"padding": 1}, [(2, 3, 6, 6)]),
    Case("Conv2d-strided-grouped", "Conv2d", (4, 6, (3, 2)),
         {"stride": (2, 1), "padding": (1, 0), "dilation": (1, 2), "groups": 2}, [(2, 4, 7, 6)]),
    Case("Conv2d-reflect", "Conv2d", (3, 2, 3), {"padding": 1, "padding_mode": "reflect"},
         [(2, 3, 5, 5)]),
    Case("Conv2d-replicate", "Conv2d", (3, 2, 3), {"padding": (2, 1),
         "padding_mode": "replicate"}, [(1, 3, 4, 5)]),
    Case("Conv2d-circular-same", "Conv2d", (2, 2, (2, 3)),
         {"padding": "same", "padding_mode": "circular"}, [(1, 2, 4, 5)]),
    Case("Conv2d-same-even", "Conv2d", (2, 3, 2), {"padding": "same", "bias": False},
         [(2, 2, 5, 4)]),
    Case("Conv2d-valid-unbatched", "Conv2d", (3, 2, 3), {"padding": "valid"}, [(3, 5, 5)]),
    Case("ConvTranspose1d", "ConvTranspose1d", (2, 3, 3),
         {"stride": 2, "padding": 1, "output_padding": 1}, [(2, 2, 5)]),
    Case("ConvTranspose2d", "ConvTranspose2d", (4, 6, 3),
         {"stride": 2, "padding": 1, "output_padding": 1, "groups": 2}, [(2, 4, 3, 4)]),
    Case("ConvTranspose2d-dilated-nobias", "ConvTranspose2d", (3, 2, (2, 3)),
         {"dilation": (2, 1), "bias": False}, [(2, 3, 3, 3)]),
    Case("ConvTranspose2d-output_size", "ConvTranspose2d", (2, 3, 3), {"stride": 2},
         [(1, 2, 3, 3)], forward={"output_size": [8, 7]}),
    Case("LayerNorm", "LayerNorm", (5,), {}, [(2, 3, 5)]),
    Case("LayerNorm-2d-nobias", "LayerNorm", ((3, 5),), {"bias": False, "eps": 1e-3},
         [(2, 3, 5)]),
    Case("LayerNorm-noaffine", "LayerNorm", (4,), {"elementwise_affine": False}, [(3, 4)]),
    Case("GroupNorm", "GroupNorm", (2, 4), {}, [(2, 4, 3, 3)]),
    Case("GroupNorm-noaffine", "GroupNorm", (1, 3), {"affine": False}, [(2, 3, 5)]),
    Case("GroupNorm-nobias", "GroupNorm", (3, 6), {"bias": False, "eps": 1e-3}, [(2, 6, 2)]),
    Case("RMSNorm", "RMSNorm", (6,), {}, [(2, 6)]),
    Case("RMSNorm-2d-eps", "RMSNorm", ((2, 6),), {"eps": 1e-3}, [(3, 2, 6)]),
    Case("RMSNorm-noaffine", "RMSNorm", (4,), {"elementwise_affine": False}, [(3, 4)]),
    Case("Embedding", "Embedding", (10, 4), {}, [(2, 3)], indices=10),
    Case("Embedding-padding_idx", "Embedding", (6, 3), {"padding_idx": 2}, [(4, 5)], indices=6),
    Case("BatchNorm1d", "BatchNorm1d", (4,), {}, [(6, 4)]),
    Case("BatchNorm1d-3d-noaffine", "BatchNorm1d", (3,), {"affine": False, "momentum": None},
         [(4, 3, 5)]),
    Case("BatchNorm2d", "BatchNorm2d", (3,), {"eps": 1e-3}, [(4, 3, 2, 2)]),
    Case("BatchNorm2d-untracked", "BatchNorm2d", (2,), {"track_running_stats": False},
         [(2, 2, 3, 3)]),
]  # fmt: skip


def case_id(case: Case) -> str:
    return case.id


# --- helpers -----------------------------------------------------------------------------------


def randomized(torch, module, seed: int = 0):
    """PyTorch's module with every floating parameter redrawn (norms would otherwise hold
    ones and zeros, and their gradients would be checked at a trivial point)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5 + 0.2)
    return module


def through_safetensors(torch_module, path) -> dict:
    """PyTorch's ``state_dict``, written by safetensors.torch and read back for FLAME."""
    from safetensors.torch import save_file

    save_file(torch_module.state_dict(), str(path))
    try:
        from flame.io import load_file
    except ImportError:
        from safetensors.numpy import load_file as load_numpy

        return {key: fl.tensor(value) for key, value in load_numpy(str(path)).items()}
    return load_file(str(path), device="cpu")


def assert_close(got, expected, what: str, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    np.testing.assert_allclose(
        np.asarray(got), np.asarray(expected), rtol=rtol, atol=atol, err_msg=what
    )


def run_flame(module, arrays, forward: dict, cotangent):
    """Forward ``module`` on ``arrays``, backward ``sum(output * cotangent)``: the output,
    the input gradients (None for integer inputs) and ``{name: parameter gradient}``."""
    inputs = [fl.tensor(array) for array in arrays]
    for tensor in inputs:
        if tensor.dtype.is_float:
            tensor.requires_grad_()
    output = module(*inputs, **forward)
    if cotangent is not None:
        (output * fl.tensor(cotangent)).sum().backward()
    input_grads = [None if t.grad is None else t.grad.numpy() for t in inputs]
    grads = {name: p.grad.numpy() for name, p in module.named_parameters() if p.grad is not None}
    return output.numpy(), input_grads, grads


def run_torch(torch, module, arrays, forward: dict, rng):
    """As ``run_flame`` for PyTorch's module, with a cotangent drawn from ``rng`` (returned
    last)."""
    inputs = [torch.from_numpy(array) for array in arrays]
    for tensor in inputs:
        if tensor.is_floating_point():
            tensor.requires_grad_()
    output = module(*inputs, **forward)
    cotangent = rng.standard_normal(tuple(output.shape)).astype(np.float32)
    (output * torch.from_numpy(cotangent)).sum().backward()
    input_grads = [None if t.grad is None else t.grad.numpy() for t in inputs]
    grads = {n: p.grad.numpy() for n, p in module.named_parameters() if p.grad is not None}
    return output.detach().numpy(), input_grads, grads, cotangent


# --- state_dict and repr -------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_state_dict_and_repr_match_pytorch(case, reference_backend):
    torch = pytest.importorskip("torch")
    expected = case.make(torch)
    module = case.make(None)
    assert repr(module) == repr(expected)
    ours = module.state_dict()
    theirs = expected.state_dict()
    assert list(ours) == list(theirs)
    for key, value in theirs.items():
        assert tuple(ours[key].shape) == tuple(value.shape), key
        assert ours[key].dtype.name == str(value.dtype).removeprefix("torch."), key
    assert [name for name, _ in module.named_parameters()] == [
        name for name, _ in expected.named_parameters()
    ]
    for name, param in module.named_parameters():
        assert param.requires_grad == expected.get_parameter(name).requires_grad, name


# --- forward and gradients against PyTorch ------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_forward_and_gradients_match_pytorch(case, reference_backend, rng, tmp_path):
    torch = pytest.importorskip("torch")
    expected = randomized(torch, case.make(torch))
    module = case.make(None)
    module.load_state_dict(through_safetensors(expected, tmp_path / "weights.safetensors"))
    arrays = case.inputs(rng)
    want_output, want_inputs, want_grads, cotangent = run_torch(
        torch, expected, arrays, case.forward, rng
    )
    output, input_grads, grads = run_flame(module, arrays, case.forward, cotangent)
    assert_close(output, want_output, "output")
    for index, (got, want) in enumerate(zip(input_grads, want_inputs)):
        if want is None:
            assert got is None
        else:
            assert_close(got, want, f"gradient of input {index}")
    assert sorted(grads) == sorted(want_grads)
    for name, want in want_grads.items():
        assert_close(grads[name], want, f"gradient of {name}")
