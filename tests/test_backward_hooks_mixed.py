"""Full backward hooks on a module whose tensors have different dtypes (flame/nn/modules/
hooks.py): the hook sees each gradient in its tensor's dtype, what it returns flows on, and
values and dtypes match PyTorch's."""

from __future__ import annotations

import numpy as np
import pytest

import flame as fl
import flame.nn as nn


class Mixed(nn.Module):
    """Inputs of two dtypes, outputs of two dtypes."""

    def forward(self, a, b):
        product = a.to(b.dtype) * b
        return product.sum(dim=0), (a * 2).exp()


def _torch_mixed(torch):
    class TMixed(torch.nn.Module):
        def forward(self, a, b):
            product = a.to(b.dtype) * b
            return product.sum(dim=0), (a * 2).exp()

    return TMixed()


@pytest.mark.parametrize("dtypes", [("float32", "float64"), ("float64", "float32")])
def test_mixed_dtype_backward_hooks_match_torch(dtypes, reference_backend):
    torch = pytest.importorskip("torch", reason="PyTorch is the reference for these checks")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 4))
    y = rng.standard_normal((3, 4))
    seen = {}

    def hook_for(tag):
        def hook(module, grad_input, grad_output):
            seen[tag] = [(g.dtype, np.asarray(g.detach().numpy())) for g in grad_input]
            seen[tag] += [(g.dtype, np.asarray(g.detach().numpy())) for g in grad_output]
            return (grad_input[0] * 3, grad_input[1])

        return hook

    ours, theirs = Mixed(), _torch_mixed(torch)
    ours.register_full_backward_hook(hook_for("flame"))
    theirs.register_full_backward_hook(hook_for("torch"))
    first, second = dtypes
    a = fl.tensor(x.astype(first)).requires_grad_()
    b = fl.tensor(y.astype(second)).requires_grad_()
    ta = torch.from_numpy(x.astype(first)).requires_grad_()
    tb = torch.from_numpy(y.astype(second)).requires_grad_()
    summed, grown = ours(a, b)
    ((summed**2).sum() + grown.sum()).backward()
    tsummed, tgrown = theirs(ta, tb)
    ((tsummed**2).sum() + tgrown.sum()).backward()
    assert len(seen["flame"]) == len(seen["torch"]) == 4
    for (ours_dtype, got), (their_dtype, expected) in zip(seen["flame"], seen["torch"]):
        assert ours_dtype.name == str(their_dtype).removeprefix("torch."), (ours_dtype, their_dtype)
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    assert a.grad.dtype.name == first and b.grad.dtype.name == second
    np.testing.assert_allclose(a.grad.numpy(), ta.grad.numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(b.grad.numpy(), tb.grad.numpy(), rtol=1e-6, atol=1e-6)


def test_half_precision_inputs_keep_their_values_and_gradients(reference_backend):
    """bfloat16 and float32 joined in float32: the module reads each input exactly, and the
    hook's gradients come back in each input's dtype."""
    rng = np.random.default_rng(1)
    a = fl.tensor(rng.standard_normal((4, 3)).astype(np.float32)).to(fl.bfloat16)
    a.requires_grad_()
    b = fl.tensor(rng.standard_normal((4, 3)).astype(np.float32)).requires_grad_()
    seen = {}

    class Reads(nn.Module):
        def forward(self, a, b):
            seen["a"], seen["b"] = a.detach().numpy(), b.detach().numpy()
            return a.float() * b

    module = Reads()
    module.register_full_backward_hook(
        lambda module, grad_input, grad_output: seen.update(dtypes=[g.dtype for g in grad_input])
    )
    module(a, b).sum().backward()
    np.testing.assert_array_equal(seen["a"], a.detach().numpy())
    np.testing.assert_array_equal(seen["b"], b.detach().numpy())
    assert seen["dtypes"] == [fl.bfloat16, fl.float32]
    assert a.grad.dtype is fl.bfloat16
    np.testing.assert_array_equal(
        a.grad.float().numpy(), b.detach().to(fl.bfloat16).float().numpy()
    )
