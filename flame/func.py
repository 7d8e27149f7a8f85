"""Gradients as return values: PyTorch's ``autograd.grad`` and the ``torch.func`` transforms.

Nothing here writes ``.grad``; every result is built by ``cotangents`` (flame/autograd.py), so
it is a lazy tensor whose graph can be differentiated again.

- ``autograd_grad(outputs, inputs, grad_outputs=None, ...)`` is ``torch.autograd.grad``, the
  tensor form of ``flame.autograd.grad`` (which hands a callable first argument to
  ``functional_grad`` instead).
- ``grad(fn, argnums=0, has_aux=False)``, ``grad_and_value`` and ``vjp(fn, *primals,
  has_aux=False)`` follow ``torch.func``: an argument the output does not depend on gets zeros,
  and an argument may be a tuple, list or dict of tensors (its gradient has the same structure).
  No argument needs ``requires_grad``.
- ``value_and_grad`` is JAX's order, ``(value, grad)``; it and ``functional_grad``
  (``flame.grad(fn)``) raise for an unused argument unless ``allow_unused=True`` (FLAME's older
  functional API, kept as it was).
"""

from __future__ import annotations

from flame.autograd import (
    GradError,
    _at_user_line,
    _compute_now,
    _filled,
    _seeds,
    _tensors,
    cotangents,
    detach,
)  # fmt: skip
from flame.tensor import Tensor

__all__ = ["grad", "grad_and_value", "value_and_grad", "vjp"]


# --- torch.autograd.grad ----------------------------------------------------------------------


@_at_user_line
def autograd_grad(
    outputs, inputs, grad_outputs=None, retain_graph=None, create_graph=False, only_inputs=True,
    allow_unused=None, is_grads_batched=False, materialize_grads=False,
):  # fmt: skip
    """The gradients of ``outputs`` (seeded with ``grad_outputs``; ones for a one-element
    output) with respect to ``inputs`` (a tensor, a sequence, or a dict: then a dict), as a
    tuple. An input the outputs do not depend on raises, gives None (``allow_unused``) or zeros
    (``materialize_grads``). Without ``create_graph`` the results are detached and computed
    now, with the outputs (inside ``flame.compile``, when the program runs); with it they stay
    lazy and differentiable. ``is_grads_batched``: the leading axis of every ``grad_outputs``
    is a batch, one backward per row, stacked. ``retain_graph``/``only_inputs`` change nothing
    (a FLAME graph is never freed; only ``inputs`` get gradients)."""
    if materialize_grads and allow_unused is False:
        raise ValueError(
            "grad(): expected allow_unused to be True or not passed when "
            "materialize_grads=True, but got allow_unused=False"
        )
    outputs = _tensors(outputs, "outputs")
    keys = list(inputs) if isinstance(inputs, dict) else None
    targets = _tensors(inputs if keys is None else inputs.values(), "inputs")
    if not outputs or not targets:
        raise GradError("grad(): `outputs` and `inputs` cannot be empty")
    for index, target in enumerate(targets):
        if not target.dtype.is_float:
            raise GradError(
                f"grad(): inputs[{index}] is {target.dtype.name}{list(target.shape)}; only "
                "floating point tensors have gradients"
            )
    if is_grads_batched:
        grads = _batched(outputs, grad_outputs, targets)
    else:
        grads = _gradients(outputs, grad_outputs, targets)
    if not create_graph:
        grads = [None if g is None else detach(g) for g in grads]
        _compute_now(outputs, grads)
    if allow_unused is None:
        allow_unused = materialize_grads
    result = []
    for index, (target, gradient) in enumerate(zip(targets, grads)):
        if gradient is None and materialize_grads:
            gradient = _filled(target, 0)
        elif gradient is None and not allow_unused:
            raise GradError(
                f"grad(): inputs[{index}] ({target.dtype.name}{list(target.shape)}): One of "
                "the differentiated Tensors appears to not have been used in the graph. Set "
                "allow_unused=True if this is the desired behavior."
            )
        result.append(gradient)
    return tuple(result) if keys is None else dict(zip(keys, result))


def _gradients(outputs, grad_outputs, targets) -> list:
    seeds = _seeds(outputs, grad_outputs, "grad()", "grad_outputs")
    for index, (out, seed) in enumerate(zip(outputs, seeds)):
        if seed.shape != out.shape:
            raise GradError(
                f"grad(): Mismatch in shape: grad_outputs[{index}] has a shape of "
                f"{list(seed.shape)} and outputs[{index}] has a shape of {list(out.shape)}"
            )
    total = cotangents(outputs, seeds, [t.node for t in targets], outputs[0].backend)
    return [total.get(id(t.node)) for t in targets]


def _batched(outputs, grad_outputs, targets) -> list:
    """One backward per row of the ``grad_outputs`` (their leading axis), stacked."""
    from flame.joining import stack
    from flame.shaping import unbind

    given = [grad_outputs] if isinstance(grad_outputs, Tensor) else list(grad_outputs or ())
    if len(given) != len(outputs) or not all(isinstance(g, Tensor) and g.ndim for g in given):
        raise GradError(
            "grad(is_grads_batched=True): needs one grad_outputs tensor per output, each with "
            f"a leading batch axis ({len(outputs)} outputs)"
        )
    sizes = sorted({g.shape[0] for g in given})
    if len(sizes) != 1 or sizes[0] == 0:
        raise GradError(
            "grad(is_grads_batched=True): the grad_outputs need one non-zero batch size, got "
            f"{[list(g.shape) for g in given]}"
        )
    rows = [_gradients(outputs, row, targets) for row in zip(*(unbind(g, 0) for g in given))]
    stacked = []
    for index, target in enumerate(targets):
        column = [row[index] for row in rows]
        if all(g is None for g in column):
            stacked.append(None)
            continue
        stacked.append(stack([_filled(target, 0) if g is None else g for g in column]))
    return stacked


# --- torch.func -------------------------------------------------------------------------------


def vjp(fn, *primals, has_aux: bool = False):
    """``(outputs, vjp_fn)`` (``(outputs, vjp_fn, aux)`` with ``has_aux``): ``vjp_fn`` takes
    the cotangents of the outputs (one argument shaped as the outputs, as ``torch.func``'s, or
    one argument per output) and gives a cotangent per primal (zeros where the outputs do not
    depend on it; a primal that is a tuple, list or dict gets one of the same structure)."""
    outputs = fn(*primals)
    if has_aux:
        outputs, aux = _split_aux(outputs, "vjp")
    out_leaves = _tensors(_flatten(outputs)[0], "vjp: outputs")
    trees = [_flatten(primal) for primal in primals]
    targets = _tensors([leaf for leaves, _ in trees for leaf in leaves], "vjp: primals")

    @_at_user_line
    def vjp_fn(*cotangent):
        seeds = _tensors(_flatten(cotangent[0] if len(cotangent) == 1 else cotangent)[0], "vjp")
        if len(seeds) != len(out_leaves):
            raise GradError(f"vjp: {len(out_leaves)} outputs and {len(seeds)} cotangents")
        total = cotangents(list(out_leaves), list(seeds), [t.node for t in targets],
                           out_leaves[0].backend)  # fmt: skip
        found = iter([_or_zeros(total.get(id(t.node)), t, True) for t in targets])
        return tuple(rebuild([next(found) for _ in leaves]) for leaves, rebuild in trees)

    return (outputs, vjp_fn, aux) if has_aux else (outputs, vjp_fn)


def value_and_grad(fn, argnums=0, allow_unused: bool = False, has_aux: bool = False):
    """``value_and_grad(fn)(*args) -> (value, grad)``; with ``has_aux`` ``fn`` returns
    ``(value, aux)`` and the result is ``((value, aux), grad)`` (JAX's order)."""

    @_at_user_line
    def wrapped(*args):
        positions = (argnums,) if isinstance(argnums, int) else tuple(argnums)
        value = fn(*args)
        if has_aux:
            value, aux = _split_aux(value, "grad")
        if not isinstance(value, Tensor) or value.numel() != 1:
            shown = list(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise GradError(f"grad: the function must return a one-element tensor, got {shown}")
        trees = [_flatten(args[position]) for position in positions]
        targets = [target for leaves, _ in trees for target in leaves]
        for target in targets:
            if not isinstance(target, Tensor) or not target.dtype.is_float:
                shown = target.dtype.name if isinstance(target, Tensor) else type(target).__name__
                raise GradError(
                    f"grad: argument to differentiate must be a float tensor, got {shown}"
                )
        seed = _filled(value, 1)
        total = cotangents([value], [seed], [t.node for t in targets], value.backend)
        found = iter([_or_zeros(total.get(id(t.node)), t, allow_unused) for t in targets])
        grads = tuple(rebuild([next(found) for _ in leaves]) for leaves, rebuild in trees)
        result = grads[0] if isinstance(argnums, int) else grads
        return ((value, aux) if has_aux else value), result

    return wrapped


def grad_and_value(fn, argnums=0, has_aux: bool = False):
    """``torch.func.grad_and_value``: ``(grad, value)``, or ``(grad, (value, aux))``."""
    inner = value_and_grad(fn, argnums, allow_unused=True, has_aux=has_aux)

    def wrapped(*args):
        value, gradient = inner(*args)
        return gradient, value

    return wrapped


def grad(fn, argnums=0, has_aux: bool = False):
    """``torch.func.grad``: the gradient of a one-element ``fn`` w.r.t. ``args[argnums]``
    (zeros for an argument it does not use); ``(grad, aux)`` with ``has_aux``."""
    return functional_grad(fn, argnums, allow_unused=True, has_aux=has_aux)


def functional_grad(fn, argnums=0, allow_unused: bool = False, has_aux: bool = False):
    """``flame.grad(fn)``: as ``grad`` but an unused argument raises unless ``allow_unused``."""
    inner = value_and_grad(fn, argnums, allow_unused, has_aux)

    def wrapped(*args):
        value, gradient = inner(*args)
        return (gradient, value[1]) if has_aux else gradient

    return wrapped


def _split_aux(result, name: str):
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise GradError(
            f"{name}(has_aux=True): the function must return (output, aux), "
            f"got {type(result).__name__}"
        )
    return result[0], result[1]


def _flatten(tree):
    """``(leaves, rebuild)`` of a tensor or a nest of tuples, lists and dicts of them (a
    namedtuple is rebuilt as itself)."""
    if isinstance(tree, (tuple, list)):
        parts = [_flatten(item) for item in tree]

        def rebuild(values):
            values = iter(values)
            items = [part_rebuild([next(values) for _ in leaves]) for leaves, part_rebuild in parts]
            if hasattr(tree, "_fields"):
                return type(tree)(*items)
            return type(tree)(items)

        return [leaf for leaves, _ in parts for leaf in leaves], rebuild
    if isinstance(tree, dict):
        keys = list(tree)
        leaves, rebuild_values = _flatten([tree[key] for key in keys])
        return leaves, lambda values: dict(zip(keys, rebuild_values(values)))
    return [tree], lambda values: values[0]


def _or_zeros(gradient, target: Tensor, allow_unused: bool):
    if gradient is not None:
        return gradient
    if not allow_unused:
        raise GradError(
            f"a {target.dtype.name}{list(target.shape)} input does not influence the output "
            "(pass allow_unused=True to get zeros)"
        )
    return _filled(target, 0)
