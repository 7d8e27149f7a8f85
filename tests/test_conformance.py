"""Op conformance against PyTorch (issue 18), driven by ``conformance_table.CASES``.

Each case runs its call once through FLAME and once through PyTorch on the same NumPy inputs:
the forward values must agree (shape, dtype, values, NaN positions), and for differentiable
cases the gradient of ``sum(out * cotangent)`` with respect to every float input must agree too.
The ``backend`` fixture runs each body on the reference backend (CPU tier) and on the GPU (the
``gpu`` tier, skipped where there is none). A FLAME gap or bug is an ``xfail(strict=True)`` whose
reason says what differs, so a fix shows up as an unexpected pass.
"""

from __future__ import annotations

import zlib
from types import SimpleNamespace

import numpy as np
import pytest
from conformance_table import CASES, ERRORS, Case

import flame as fl
import flame.nn.functional as flame_functional

torch = pytest.importorskip("torch", reason="PyTorch is the oracle of the conformance table")

FLAME = SimpleNamespace(name="flame", fl=fl, F=flame_functional)
TORCH = SimpleNamespace(name="torch", fl=torch, F=torch.nn.functional)
TOLERANCES = {
    "float64": 1e-9,
    "float32": 2e-5,
    "float16": 1e-2,
}  # relative and absolute, per input dtype
MINIMUM_CASES, MINIMUM_GRADIENT_CASES = 1000, 700
REQUIRED_OPS = """
    erf erfinv atan2 copysign fmod remainder logaddexp trunc exp2 log2 log10 sin cos tan asin acos
    atan sinh cosh tanh asinh acosh atanh nan_to_num clamp pow sum mean prod amax amin max min
    argmax argmin var std logsumexp any all norm cumsum cumprod cummax cummin logcumsumexp sort
    argsort topk reshape view permute transpose squeeze unsqueeze flatten unflatten chunk split
    unbind movedim roll flip repeat repeat_interleave tril triu diag diagonal cat stack pad gather
    index_select take_along_dim scatter scatter_add scatter_reduce masked_fill masked_select
    getitem arange linspace logspace eye zeros ones full softmax log_softmax layer_norm group_norm
    rms_norm normalize relu gelu silu elu celu selu relu6 hardtanh hardswish hardsigmoid
    logsigmoid mish softmin softsign cross_entropy nll_loss mse_loss l1_loss smooth_l1_loss
    huber_loss kl_div binary_cross_entropy binary_cross_entropy_with_logits matmul bmm einsum
    promote-add add_ mul_ lerp_ clamp_ addcmul_ masked_fill_ setitem-slice setitem-mask
""".split()
pytestmark = pytest.mark.filterwarnings("ignore:.*degrees of freedom is <= 0:UserWarning")

# FLAME bugs and gaps against PyTorch, found by this table: case id -> what differs.
# A key "<id>" marks the forward and backward tests, "<id>/forward" and "<id>/grad" one of them;
# "*" in place of the dtype marks the case at every dtype.
XFAILS: dict[str, str] = {}


def as_outputs(result) -> list:
    """The tensors a call returned, in order (a tuple, a named pair, or one tensor)."""
    if isinstance(result, (tuple, list)):
        return list(result)
    return [result]


def dtype_name(tensor) -> str:
    if isinstance(tensor, torch.Tensor):
        return str(tensor.dtype).removeprefix("torch.")
    return tensor.dtype.name


def to_numpy(tensor) -> np.ndarray:
    if isinstance(tensor, torch.Tensor):
        return tensor.detach().numpy()
    return np.asarray(tensor.numpy())


def tolerance(case: Case) -> float:
    """The dtype's tolerance, loosened where the case says so (never tightened)."""
    return max(case.tolerance or 0.0, TOLERANCES.get(case.dtype, TOLERANCES["float32"]))


def run(case: Case, lib, *, grad: bool):
    """The case's outputs through ``lib`` and, with ``grad``, the gradient of each float input
    (None where an input is not differentiated) for a seeded cotangent of each float output."""
    arrays = case.arrays()
    differentiated = [grad and array.dtype.kind == "f" for array in arrays]
    if lib is TORCH:
        inputs = [
            torch.tensor(array, requires_grad=wanted)
            for array, wanted in zip(arrays, differentiated)
        ]
    else:
        inputs = [
            fl.tensor(array, requires_grad=wanted) for array, wanted in zip(arrays, differentiated)
        ]
    outputs = as_outputs(case.call(lib, *inputs))
    if not grad:
        return outputs, []
    loss = None
    for position, output in enumerate(outputs):
        if not dtype_name(output).startswith("float"):
            continue
        cotangent = cotangent_for(case, position, tuple(output.shape), dtype_name(output))
        tensor = torch.tensor(cotangent) if lib is TORCH else fl.tensor(cotangent)
        term = (output * tensor).sum()
        loss = term if loss is None else loss + term
    loss.backward()
    grads = [tensor.grad if wanted else None for tensor, wanted in zip(inputs, differentiated)]
    return outputs, grads


def cotangent_for(case: Case, position: int, shape: tuple, dtype: str) -> np.ndarray:
    seed = zlib.crc32(f"{case.id}/{position}".encode())
    return np.random.default_rng(seed).uniform(0.5, 1.5, shape).astype(dtype)


def assert_close(actual, expected, case: Case, what: str) -> None:
    actual_array, expected_array = to_numpy(actual), to_numpy(expected)
    assert tuple(actual_array.shape) == tuple(expected_array.shape), f"{what}: shape"
    assert dtype_name(actual) == dtype_name(expected), f"{what}: dtype"
    if expected_array.dtype.kind in "biu":
        np.testing.assert_array_equal(actual_array, expected_array, err_msg=what)
        return
    limit = tolerance(case)
    np.testing.assert_allclose(
        actual_array.astype(np.float64),
        expected_array.astype(np.float64),
        rtol=limit,
        atol=limit,
        equal_nan=True,
        err_msg=what,
    )
    if case.variant != "edges":
        return  # elsewhere a zero's sign is noise (hardswish's -0.0, gradients' signed zeros)
    zeros = expected_array == 0  # at the edges (inputs +-0.0) a zero's sign must match too
    np.testing.assert_array_equal(
        np.signbit(actual_array[zeros]), np.signbit(expected_array[zeros]), f"{what}: sign of 0"
    )


def wildcard_id(case: Case) -> str:
    return "-".join(part for part in (case.op, "*", case.variant) if part)


def known_bug(case: Case, suffix: str = "") -> str | None:
    return XFAILS.get(case.id + suffix) or XFAILS.get(wildcard_id(case) + suffix)


def with_xfail(case: Case):
    reason = known_bug(case, "/forward") or known_bug(case)
    marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
    return pytest.param(case, id=case.id, marks=marks)


def grad_xfail(case: Case):
    reason = known_bug(case, "/grad") or known_bug(case)
    marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
    return pytest.param(case, id=case.id, marks=marks)


@pytest.mark.parametrize("case", [with_xfail(case) for case in CASES])
def test_forward_matches_torch(case: Case, backend):
    expected, _ = run(case, TORCH, grad=False)
    actual, _ = run(case, FLAME, grad=False)
    assert len(actual) == len(expected), "number of outputs"
    for position, (output, reference) in enumerate(zip(actual, expected)):
        assert_close(output, reference, case, f"{case.id} output {position}")


@pytest.mark.parametrize("case", [grad_xfail(case) for case in CASES if case.grad])
def test_backward_matches_torch(case: Case, backend):
    _, expected = run(case, TORCH, grad=True)
    _, actual = run(case, FLAME, grad=True)
    for position, (grad, reference) in enumerate(zip(actual, expected)):
        if reference is None and grad is None:
            continue
        assert grad is not None and reference is not None, f"input {position}: a gradient is None"
        assert_close(grad, reference, case, f"{case.id} grad of input {position}")


def builtin_class(error: BaseException) -> type:
    """The first builtin exception class of ``error`` (PyTorch raises its own subclasses)."""
    return next(kind for kind in type(error).__mro__ if kind.__module__ == "builtins")


# refused on the reference backend only: the GPU kernels do not read index values back
def refusal_param(name: str):
    reason = XFAILS.get(f"refusal/{name}")
    marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
    return pytest.param(name, id=name, marks=marks)


@pytest.mark.parametrize("name", [refusal_param(name) for name in ERRORS])
def test_refusals_match_torch(name: str, backend):
    """What PyTorch refuses, FLAME refuses with the same builtin error class, at the call or
    at the latest when the value is read (FLAME is lazy)."""
    call, arrays = ERRORS[name]
    with pytest.raises(Exception) as expected:
        call(TORCH, *[torch.tensor(np.asarray(array)) for array in arrays])
    with pytest.raises(builtin_class(expected.value)):
        result = call(FLAME, *[fl.tensor(np.asarray(array)) for array in arrays])
        for output in as_outputs(result):
            output.numpy()


def test_case_ids_are_unique():
    ids = [case.id for case in CASES]
    assert len(ids) == len(set(ids)), sorted({name for name in ids if ids.count(name) > 1})


def test_table_does_not_shrink():
    assert len(CASES) >= MINIMUM_CASES
    assert sum(case.grad for case in CASES) >= MINIMUM_GRADIENT_CASES
    missing = sorted(set(REQUIRED_OPS) - {case.op for case in CASES})
    assert not missing, f"ops no longer in the table: {missing}"
    known = {case.id for case in CASES} | {wildcard_id(case) for case in CASES}
    known |= {f"refusal/{name}" for name in ERRORS}
    stale = [
        key for key in XFAILS if key.removesuffix("/grad").removesuffix("/forward") not in known
    ]
    assert not stale, f"xfails of cases no longer in the table: {stale}"
