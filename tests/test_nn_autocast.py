"""Layer modules under bfloat16 autocast against PyTorch's CPU autocast (issue 19).

Each layer is built in PyTorch (CPU) with every parameter redrawn (the composite block:
its norm's), its weights go to the
FLAME layer through a safetensors file (``safetensors.torch.save_file``, ``flame.load_file``,
``load_state_dict``), then both run forward and backward, PyTorch under
``torch.autocast("cpu", dtype=torch.bfloat16)`` and FLAME under
``flame.autocast("cpu", dtype=flame.bfloat16)`` on the reference backend. Compared: the
output dtype, the output values, every parameter gradient (float32: the master weights stay
float32) and the input gradient. The backward runs outside the region, as PyTorch advises.

Dtypes. FLAME has one policy for every backend (flame/amp/autocast_mode.py): PyTorch's
CUDA lists, under which layer/group/rms norm (and, in FLAME, batch norm) run in float32
whatever their input's dtype. PyTorch's CPU autocast leaves those norms off its float32
list: given a bfloat16 input they return bfloat16. Both agree when the norm's input is
float32 (the layer tests below); the ``*-bf16-input`` cases and the composite block feed a
norm a bfloat16 value, and there FLAME's documented float32 is asserted next to PyTorch's
CPU bfloat16 (each such case names the difference in ``note``). Likewise softmax: the
attention weights MultiheadAttention returns are float32 in FLAME, bfloat16 under
PyTorch's CPU autocast.

Tolerances. bfloat16 keeps 8 significant bits: one rounding is off by up to 2**-9 of the
value, one ulp is 2**-8 (about 0.4 %) of it. The two libraries round the same operands (the
float32 weights and inputs cast to bfloat16) but may accumulate the products in another
order or round an intermediate (a bias add, the attention scores) where the other does not,
so an element may differ by a couple of ulps of the *terms* it sums, which after
cancellation can be far more than a couple of ulps of the element itself. Hence
``rtol = 2e-2`` (about five ulps) and ``atol = 2e-2 * max|expected|`` (about five ulps of
the largest value of the tensor): loose enough for rounding differences, tight enough to
catch a wrong formula, a missed cast of a weight or a gradient that skipped a term (those
are off by tens of percent). Where nothing runs in bfloat16 (a norm or an embedding on a
float32 input) both libraries compute in float32: ``rtol = 1e-4``, ``atol = 1e-5`` of the
largest value, as tests/test_nn_layers.py. The composite block widens the bfloat16
tolerance by PyTorch's own error against float64 (its test says why).

Tests that need PyTorch import it themselves (``pytest.importorskip``): without it every
test here skips, with the reason.
"""

from __future__ import annotations

import numpy as np
import pytest

import flame as fl
import flame.nn as nn

BF16_TOLERANCE = {"rtol": 2e-2, "atol": 2e-2}  # atol scales with the tensor's magnitude
F32_TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}


# --- helpers --------------------------------------------------------------------------------------


def _torch():
    torch = pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    return torch


def _randomized(torch, module, seed: int = 0):
    """PyTorch's module with every floating parameter redrawn (norms would otherwise hold
    ones and zeros)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5 + 0.2)
    return module


def _load_through_safetensors(torch_module, flame_module, path) -> None:
    """PyTorch's ``state_dict`` written by safetensors.torch, read by ``flame.load_file``
    and loaded into ``flame_module``."""
    from safetensors.torch import save_file

    state = {key: value.contiguous() for key, value in torch_module.state_dict().items()}
    save_file(state, str(path))
    flame_module.load_state_dict(fl.load_file(str(path), device="cpu"))


def _name(dtype) -> str:
    """A FLAME or PyTorch dtype's name: ``float32``, ``bfloat16``."""
    return getattr(dtype, "name", None) or str(dtype).removeprefix("torch.")


def _assert_close(got, want, what: str, tolerance: dict) -> None:
    got = np.asarray(got, dtype=np.float32)
    want = np.asarray(want, dtype=np.float32)
    assert got.shape == want.shape, what
    scale = float(np.abs(want).max()) if want.size else 0.0
    np.testing.assert_allclose(
        got, want, rtol=tolerance["rtol"], atol=tolerance["atol"] * max(scale, 1e-3),
        err_msg=what,
    )  # fmt: skip


def _numpy(tensor) -> np.ndarray:
    """A FLAME or PyTorch tensor's values as float32 (bfloat16 widened exactly)."""
    if hasattr(tensor, "detach"):
        return tensor.detach().float().numpy()
    return tensor.float().numpy()


# --- single layers --------------------------------------------------------------------------------


class Case:
    """``make(nn)`` builds the layer from either library's ``nn``; it runs on inputs of
    ``shape`` (int64 indices below ``indices`` instead of floats; cast to bfloat16 inside
    the region first when ``bf16_input``). ``torch_dtype``/``flame_dtype``: the output dtypes
    of PyTorch's CPU autocast and of FLAME's documented policy; ``lowered``: some op runs in
    bfloat16 (bfloat16 tolerance) rather than all in float32; ``note``: why the dtypes
    differ, where they do."""

    def __init__(self, id, make, shape, torch_dtype, flame_dtype=None, lowered=True,  # noqa: A002
                 indices=None, bf16_input=False, note=""):  # fmt: skip
        self.id, self.make, self.shape = id, make, shape
        self.torch_dtype, self.flame_dtype = torch_dtype, flame_dtype or torch_dtype
        self.lowered, self.indices, self.bf16_input, self.note = lowered, indices, bf16_input, note

    def inputs(self, rng) -> np.ndarray:
        if self.indices is not None:
            return rng.integers(0, self.indices, self.shape).astype(np.int64)
        return rng.standard_normal(self.shape).astype(np.float32)


NORM_ON_BF16 = (
    "PyTorch's CPU autocast leaves {} off its float32 list (a bfloat16 input gives a bfloat16 "
    "output); FLAME's single policy is PyTorch's CUDA lists plus batch norm: float32"
)

CASES = [
    # the lower-precision list: bfloat16 out in both
    Case("Linear", lambda nn: nn.Linear(6, 5), (3, 6), "bfloat16"),
    Case("Linear-3d-nobias", lambda nn: nn.Linear(4, 3, bias=False), (2, 3, 4), "bfloat16"),
    Case("Conv1d", lambda nn: nn.Conv1d(3, 4, 3, padding=1), (2, 3, 7), "bfloat16"),
    Case("Conv2d", lambda nn: nn.Conv2d(3, 4, 3, padding=1), (2, 3, 5, 5), "bfloat16"),
    Case("Conv2d-strided-grouped",
         lambda nn: nn.Conv2d(4, 6, (3, 2), stride=(2, 1), padding=(1, 0), groups=2),
         (2, 4, 6, 5), "bfloat16"),
    Case("ConvTranspose2d",
         lambda nn: nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2),
         (2, 4, 3, 4), "bfloat16"),
    # norms on a float32 input: float32 in both, nothing in bfloat16
    Case("GroupNorm", lambda nn: nn.GroupNorm(2, 4), (2, 4, 3, 3), "float32", lowered=False),
    Case("LayerNorm", lambda nn: nn.LayerNorm(5), (2, 3, 5), "float32", lowered=False),
    Case("RMSNorm", lambda nn: nn.RMSNorm(6), (3, 6), "float32", lowered=False),
    Case("BatchNorm2d-train", lambda nn: nn.BatchNorm2d(3), (4, 3, 2, 3), "float32",
         lowered=False),
    # Embedding is on neither list: its float32 weight gives float32 rows
    Case("Embedding", lambda nn: nn.Embedding(10, 4), (2, 3), "float32", lowered=False,
         indices=10),
    Case("Embedding-padding_idx", lambda nn: nn.Embedding(6, 3, padding_idx=2), (4, 5),
         "float32", lowered=False, indices=6),
    # norms on a bfloat16 input (as after a Linear or a Conv): the policies differ
    Case("GroupNorm-bf16-input", lambda nn: nn.GroupNorm(2, 4), (2, 4, 3, 3), "bfloat16",
         "float32", bf16_input=True, note=NORM_ON_BF16.format("group_norm")),
    Case("LayerNorm-bf16-input", lambda nn: nn.LayerNorm(5), (2, 3, 5), "bfloat16", "float32",
         bf16_input=True, note=NORM_ON_BF16.format("layer_norm")),
    Case("RMSNorm-bf16-input", lambda nn: nn.RMSNorm(6), (3, 6), "bfloat16", "float32",
         bf16_input=True, note=NORM_ON_BF16.format("rms_norm")),
    # PyTorch's CUDA autocast lists no batch_norm either (cuDNN takes a half input with float
    # weights): FLAME's float32 here is its own choice ("norms"), unlike PyTorch on any device
    Case("BatchNorm2d-train-bf16-input", lambda nn: nn.BatchNorm2d(3), (4, 3, 2, 3), "bfloat16",
         "float32", bf16_input=True, note=NORM_ON_BF16.format("batch_norm")),
]  # fmt: skip


def _run_torch(torch, module, array, case: Case, rng):
    """Forward under PyTorch's CPU autocast, backward of ``sum(output * cotangent)`` outside
    it: (output, input gradient or None, {name: parameter gradient}, cotangent)."""
    x = torch.from_numpy(array.copy())
    if case.indices is None:
        x.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        output = module(x.to(torch.bfloat16) if case.bf16_input else x)
    cotangent = rng.standard_normal(tuple(output.shape)).astype(np.float32)
    (output * torch.from_numpy(cotangent)).sum().backward()
    grads = {name: p.grad for name, p in module.named_parameters() if p.grad is not None}
    return output, x.grad, grads, cotangent


def _run_flame(module, array, case: Case, cotangent):
    x = fl.tensor(array)
    if case.indices is None:
        x.requires_grad_()
    with fl.autocast("cpu", dtype=fl.bfloat16):
        output = module(x.to(fl.bfloat16) if case.bf16_input else x)
    (output * fl.tensor(cotangent)).sum().backward()
    grads = {name: p.grad for name, p in module.named_parameters() if p.grad is not None}
    return output, x.grad, grads


# PyTorch's rms_norm on a bfloat16 input with a float32 weight warns that it cannot fuse
@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_layer_under_autocast_matches_pytorch(case, reference_backend, rng, tmp_path):
    torch = _torch()
    torch.manual_seed(0)
    fl.manual_seed(0)
    theirs = _randomized(torch, case.make(torch.nn)).train()
    ours = case.make(nn).train()
    _load_through_safetensors(theirs, ours, tmp_path / "weights.safetensors")
    array = case.inputs(rng)
    want, want_input_grad, want_grads, cotangent = _run_torch(torch, theirs, array, case, rng)
    got, input_grad, grads = _run_flame(ours, array, case, cotangent)
    tolerance = BF16_TOLERANCE if case.lowered or case.bf16_input else F32_TOLERANCE

    # (1) output dtype: PyTorch's CPU autocast as recorded, FLAME's documented policy
    assert _name(want.dtype) == case.torch_dtype, "PyTorch's CPU autocast changed"
    assert _name(got.dtype) == case.flame_dtype, case.note or "dtype differs from PyTorch's"
    # (2) output values
    _assert_close(_numpy(got), _numpy(want), "output", tolerance)
    # (3) parameter gradients: float32 master weights, float32 gradients, PyTorch's values
    assert sorted(grads) == sorted(want_grads) == sorted(n for n, _ in theirs.named_parameters())
    for name, want_grad in want_grads.items():
        assert _name(want_grad.dtype) == "float32", name
        assert ours.get_parameter(name).dtype is fl.float32, name
        assert grads[name].dtype is fl.float32, f"gradient of {name}"
        _assert_close(_numpy(grads[name]), _numpy(want_grad), f"gradient of {name}", tolerance)
    # (4) the input gradient (float32, the input's dtype)
    if case.indices is not None:
        assert input_grad is None and want_input_grad is None
    else:
        assert input_grad.dtype is fl.float32 and _name(want_input_grad.dtype) == "float32"
        _assert_close(_numpy(input_grad), _numpy(want_input_grad), "input gradient", tolerance)
    # BatchNorm's running statistics (float32 buffers) follow PyTorch's
    for key, value in theirs.state_dict().items():
        if key.startswith("running_"):
            ours_value = ours.state_dict()[key]
            assert ours_value.dtype is fl.float32, key
            _assert_close(_numpy(ours_value), _numpy(value), key, tolerance)


# --- MultiheadAttention ---------------------------------------------------------------------------


@pytest.mark.parametrize("need_weights", [False, True], ids=["no_weights", "weights"])
def test_multihead_attention_under_autocast_matches_pytorch(
    need_weights, reference_backend, rng, tmp_path
):
    """Self-attention (batch_first, training mode: no fast path) with a padding mask. The
    projections and the attention products run in bfloat16 in both; the output is bfloat16.
    The returned weights: PyTorch's CPU autocast leaves softmax off its float32 list and
    returns bfloat16 weights; FLAME's softmax is on its (PyTorch's CUDA) float32 list, so its
    weights are float32."""
    torch = _torch()
    torch.manual_seed(0)
    fl.manual_seed(0)
    embed, heads, batch, length = 8, 2, 2, 5
    theirs = _randomized(torch, torch.nn.MultiheadAttention(embed, heads, batch_first=True))
    ours = nn.MultiheadAttention(embed, heads, batch_first=True)
    _load_through_safetensors(theirs, ours, tmp_path / "mha.safetensors")
    x = rng.standard_normal((batch, length, embed)).astype(np.float32)
    padding = rng.random((batch, length)) < 0.3
    padding[:, 0] = False  # no row masked entirely

    xt = torch.from_numpy(x.copy()).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, want_weights = theirs(
            xt, xt, xt, key_padding_mask=torch.from_numpy(padding), need_weights=need_weights
        )
    cotangent = rng.standard_normal(tuple(want.shape)).astype(np.float32)
    loss = (want * torch.from_numpy(cotangent)).sum()
    if need_weights:
        weight_cotangent = rng.standard_normal(tuple(want_weights.shape)).astype(np.float32)
        loss = loss + (want_weights * torch.from_numpy(weight_cotangent)).sum()
    loss.backward()

    xf = fl.tensor(x).requires_grad_()
    with fl.autocast("cpu", dtype=fl.bfloat16):
        got, weights = ours(xf, xf, xf, key_padding_mask=fl.tensor(padding),
                            need_weights=need_weights)  # fmt: skip
    loss = (got * fl.tensor(cotangent)).sum()
    if need_weights:
        loss = loss + (weights * fl.tensor(weight_cotangent)).sum()
    loss.backward()

    assert _name(want.dtype) == "bfloat16" and got.dtype is fl.bfloat16
    _assert_close(_numpy(got), _numpy(want), "output", BF16_TOLERANCE)
    if need_weights:
        assert _name(want_weights.dtype) == "bfloat16", "PyTorch's CPU autocast changed"
        assert weights.dtype is fl.float32  # softmax: FLAME's float32 list (see above)
        _assert_close(_numpy(weights), _numpy(want_weights), "attention weights", BF16_TOLERANCE)
    else:
        assert weights is None and want_weights is None
    theirs_params = dict(theirs.named_parameters())
    assert sorted(n for n, _ in ours.named_parameters()) == sorted(theirs_params)
    for name, param in ours.named_parameters():
        assert param.dtype is fl.float32 and param.grad.dtype is fl.float32, name
        want_grad = theirs_params[name].grad
        _assert_close(_numpy(param.grad), _numpy(want_grad), f"gradient of {name}",
                      BF16_TOLERANCE)  # fmt: skip
    assert xf.grad.dtype is fl.float32
    _assert_close(_numpy(xf.grad), _numpy(xt.grad), "input gradient", BF16_TOLERANCE)


# --- a composite block ----------------------------------------------------------------------------


def _block(library):
    """Conv2d -> GroupNorm -> SiLU -> Conv2d plus the input (a residual), then flatten ->
    Linear -> cross_entropy; the same class over either library (the same state_dict keys).
    ``dtypes`` records each stage's dtype name."""
    lnn, functional = library.nn, library.nn.functional

    class Block(lnn.Module):
        def __init__(self, channels=4, size=4, classes=5):
            super().__init__()
            self.conv1 = lnn.Conv2d(channels, channels, 3, padding=1)
            self.norm = lnn.GroupNorm(2, channels)
            self.conv2 = lnn.Conv2d(channels, channels, 3, padding=1)
            self.head = lnn.Linear(channels * size * size, classes)
            self.dtypes = {}

        def forward(self, x, target):
            h = self.conv1(x)
            self.dtypes["conv1"] = _name(h.dtype)
            h = self.norm(h)
            self.dtypes["norm"] = _name(h.dtype)
            h = functional.silu(h)
            self.dtypes["silu"] = _name(h.dtype)
            h = self.conv2(h) + x
            self.dtypes["residual"] = _name(h.dtype)
            logits = self.head(h.flatten(1))
            self.dtypes["logits"] = _name(logits.dtype)
            loss = functional.cross_entropy(logits, target)
            self.dtypes["loss"] = _name(loss.dtype)
            return loss

    return Block()


# the dtypes both libraries give: conv and linear bfloat16, the residual add promotes to the
# float32 input, the loss float32
SHARED_DTYPES = {"conv1": "bfloat16", "residual": "float32", "logits": "bfloat16",
                 "loss": "float32"}  # fmt: skip


def test_composite_block_under_autocast_matches_pytorch(reference_backend, rng, tmp_path):
    """Dtypes: GroupNorm on conv1's bfloat16 output gives bfloat16 under PyTorch's CPU
    autocast (and SiLU keeps it); FLAME's group_norm is on its float32 list (PyTorch's CUDA
    one), so GroupNorm and SiLU give float32 there (conv2 casts back to bfloat16 either way).

    Values: conv and linear keep PyTorch's default initialisation (logits of order one:
    larger ones would make the bfloat16 rounding of the logits move the softmax by whole
    percents), the norm's affine parameters are redrawn. The gradients of conv1 and of the
    norm's parameters are sums whose terms mostly cancel (GroupNorm takes out most of a
    per-channel shift), so each library's bfloat16 result can be several percent of the
    tensor's largest value away from the exact one, and the two differ by up to the sum of
    their errors. Each tensor is therefore compared with a tolerance of the bfloat16
    tolerance plus three times PyTorch's own error against the float64 computation (FLAME's
    error is of the same size: over 40 inputs its median ratio to PyTorch's is 1.0 for
    every tensor, at most 1.12). A FLAME bug (a missed term, a wrong cast) is off by far
    more."""
    torch = _torch()
    torch.manual_seed(0)
    fl.manual_seed(0)
    theirs = _block(torch)
    _randomized(torch, theirs.norm)
    ours = _block(fl)
    _load_through_safetensors(theirs, ours, tmp_path / "block.safetensors")
    exact = _block(torch).double()
    exact.load_state_dict(theirs.state_dict())
    x = rng.standard_normal((3, 4, 4, 4)).astype(np.float32)
    target = rng.integers(0, 5, 3).astype(np.int64)

    def run_torch(module, dtype, enabled):
        xt = torch.from_numpy(x.copy()).to(dtype).requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            loss = module(xt, torch.from_numpy(target))
        loss.backward()
        grads = {name: p.grad for name, p in module.named_parameters()}
        return {"loss": loss, "input gradient": xt.grad, **grads}

    want = run_torch(theirs, torch.float32, True)
    truth = run_torch(exact, torch.float64, False)
    xf = fl.tensor(x).requires_grad_()
    with fl.autocast("cpu", dtype=fl.bfloat16):
        loss = ours(xf, fl.tensor(target))
    loss.backward()
    got = {"loss": loss, "input gradient": xf.grad}
    got.update((name, p.grad) for name, p in ours.named_parameters())

    assert theirs.dtypes == {**SHARED_DTYPES, "norm": "bfloat16", "silu": "bfloat16"}
    assert ours.dtypes == {**SHARED_DTYPES, "norm": "float32", "silu": "float32"}
    assert sorted(got) == sorted(want)
    for name, value in got.items():
        if name != "loss":  # float32 gradients of the float32 parameters and input
            assert value.dtype is fl.float32 and _name(want[name].dtype) == "float32", name
        exact_value = truth[name].detach().numpy()
        scale = max(float(np.abs(exact_value).max()), 1e-3)
        pytorch_error = float(np.abs(_numpy(want[name]) - exact_value).max()) / scale
        atol = BF16_TOLERANCE["atol"] + 3 * pytorch_error
        _assert_close(_numpy(value), _numpy(want[name]), name,
                      {"rtol": BF16_TOLERANCE["rtol"], "atol": atol})  # fmt: skip
    for name, param in ours.named_parameters():
        assert param.dtype is fl.float32, name
