"""``flame.einsum``, PyTorch's (and NumPy's) Einstein summation (the module is named
``contraction``: ``flame.einsum`` is the function).

An equation is lowered to ops FLAME already has, in three steps:

1. each operand alone: a label repeated within it becomes a ``diagonal``; a label found in no
   other operand and not in the output is summed away at once;
2. operands are combined left to right: labels shared by the pair and needed later are batch
   axes, labels needed by neither the output nor a later operand are contracted; a float pair
   becomes one ``matmul`` (cuBLAS on the GPU) over [batch, left-only, contracted] x
   [batch, contracted, right-only], an integer pair a broadcast multiply and a sum;
3. the result's axes are permuted into the output's order.

``...`` stands for the broadcast dims, aligned on the right as in broadcasting. Without
``->`` the output holds the labels seen once, in alphabetical order, after the ``...`` dims.
"""

from __future__ import annotations

from flame.amp.autocast_mode import lower_precision
from flame.ir.shapes import ShapeError, prod
from flame.linalg import matmul
from flame.reductions import plain_sum as reduce_sum
from flame.shaping import checked_tensor, diagonal, shown, user_errors
from flame.tensor import Tensor
from flame.views import expand, permute, reshape


def _labels(term: str, tensor: Tensor, ellipsis_rank: int, equation: str) -> list:
    """The label of every axis of ``tensor``: a letter, or ("...", k) for the k-th of the
    ``ellipsis_rank`` broadcast dims (right-aligned, as broadcasting aligns them)."""
    letters = term.replace("...", "")
    if not all(letter.isalpha() for letter in letters):
        raise ValueError(f"einsum: {equation!r}: labels must be letters, got {term!r}")
    if "..." not in term:
        if len(term) != tensor.ndim:
            raise ShapeError(
                f"einsum: {equation!r}: term {term!r} has {len(term)} labels for operand "
                f"{shown(tensor)}"
            )
        return list(term)
    covered = tensor.ndim - len(letters)
    if covered < 0:
        raise ShapeError(
            f"einsum: {equation!r}: term {term!r} has more labels than operand {shown(tensor)}"
        )
    before, after = term.split("...")
    dots = [("...", ellipsis_rank - covered + k) for k in range(covered)]
    return list(before) + dots + list(after)


def _parse(equation: str, operands) -> tuple[list[list], list]:
    equation = equation.replace(" ", "")
    inputs, arrow, output = equation.partition("->")
    terms = inputs.split(",")
    if len(terms) != len(operands):
        raise ValueError(
            f"einsum: {equation!r} names {len(terms)} operands but {len(operands)} were given"
        )
    ellipsis_rank = max(
        (
            t.ndim - len(term.replace("...", ""))
            for term, t in zip(terms, operands)
            if "..." in term
        ),
        default=0,
    )
    labels = [_labels(term, t, ellipsis_rank, equation) for term, t in zip(terms, operands)]
    dots = [("...", k) for k in range(ellipsis_rank)]
    if arrow:
        if output.count("...") > 1 or output.replace("...", "").count("-"):
            raise ValueError(f"einsum: {equation!r}: bad output term {output!r}")
        before, _, after = output.partition("...")
        wanted = list(before) + (dots if "..." in output else []) + list(after)
        seen = {label for group in labels for label in group}
        for label in wanted:
            if label not in seen:
                raise ValueError(f"einsum: {equation!r}: output label {label!r} is in no operand")
        if len(set(wanted)) != len(wanted):
            raise ValueError(f"einsum: {equation!r}: the output repeats a label")
    else:
        counts: dict = {}
        for group in labels:
            for label in group:
                counts[label] = counts.get(label, 0) + 1
        letters = sorted(label for label, count in counts.items() if count == 1 and label[0] != ".")
        wanted = dots + letters
    return labels, wanted


def _sizes(labels, operands, equation) -> dict:
    sizes: dict = {}
    for group, tensor in zip(labels, operands):
        for label, size in zip(group, tensor.shape):
            known = sizes.get(label, 1)
            if size != known and known != 1 and size != 1:
                name = "..." if isinstance(label, tuple) else label
                raise ShapeError(
                    f"einsum: {equation!r}: label {name!r} has sizes {known} and {size} "
                    f"(operands {', '.join(shown(t) for t in operands)})"
                )
            sizes[label] = known if size == 1 else size
    return sizes


def _take_diagonals(tensor: Tensor, group: list) -> tuple[Tensor, list]:
    """Repeated labels within one operand become one axis (its diagonal), moved last."""
    while len(set(group)) != len(group):
        for first, label in enumerate(group):
            if label in group[first + 1 :]:
                second = group.index(label, first + 1)
                tensor = diagonal(tensor, 0, first, second)
                group = [g for k, g in enumerate(group) if k not in (first, second)] + [label]
                break
    return tensor, group


def _sum_labels(tensor: Tensor, group: list, drop) -> tuple[Tensor, list]:
    axes = tuple(axis for axis, label in enumerate(group) if label in drop)
    if not axes:
        return tensor, group
    return reduce_sum(tensor, axes), [label for label in group if label not in drop]


def _arranged(tensor: Tensor, group: list, order: list, sizes: dict) -> Tensor:
    """``tensor`` with its axes in ``order`` (labels it lacks as size-1 axes), broadcast."""
    moved = permute(tensor, tuple(group.index(label) for label in order if label in group))
    present = [label for label in order if label in group]
    shape = [moved.shape[present.index(label)] if label in group else 1 for label in order]
    return expand(reshape(moved, tuple(shape)), tuple(sizes[label] for label in order))


def _contract(left, left_group, right, right_group, keep, sizes):
    """The pair's product with the labels outside ``keep`` summed; returns (tensor, labels)."""
    batch = [label for label in left_group if label in right_group and label in keep]
    contracted = [label for label in left_group if label in right_group and label not in keep]
    left_only = [label for label in left_group if label not in right_group]
    right_only = [label for label in right_group if label not in left_group]
    result_group = batch + left_only + right_only
    if not (left.dtype.is_float and right.dtype.is_float):
        order = batch + left_only + right_only + contracted
        product = _arranged(left, left_group, order, sizes) * _arranged(
            right, right_group, order, sizes
        )
        summed = (
            reduce_sum(product, tuple(range(len(result_group), len(order))))
            if contracted
            else product
        )
        return summed, result_group

    def size_of(labels):
        return prod(sizes[label] for label in labels)

    left_matrix = reshape(
        _arranged(left, left_group, batch + left_only + contracted, sizes),
        (size_of(batch), size_of(left_only), size_of(contracted)),
    )
    right_matrix = reshape(
        _arranged(right, right_group, batch + contracted + right_only, sizes),
        (size_of(batch), size_of(contracted), size_of(right_only)),
    )
    product = matmul(left_matrix, right_matrix)
    return reshape(product, tuple(sizes[label] for label in result_group)), result_group


@user_errors
def einsum(equation: str, *operands) -> Tensor:
    """Einstein summation over ``operands`` as ``equation`` says (``"bij,bjk->bik"``,
    ``"bhqd,bhkd->bhqk"``, ``"...ij->...ji"``, ``"i,j->ij"``, ``"ii->i"``, ``"ii"``)."""
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    if not isinstance(equation, str) or not operands:
        raise TypeError("einsum: expected an equation string and at least one tensor")
    for operand in operands:
        checked_tensor("einsum", operand)
    operands = lower_precision(*operands)  # autocast: einsum is on the lower-precision list
    labels, wanted = _parse(equation, operands)
    sizes = _sizes(labels, operands, equation)
    pending = []
    for position, (tensor, group) in enumerate(zip(operands, labels)):
        tensor, group = _take_diagonals(tensor, group)
        elsewhere = {label for k, other in enumerate(labels) if k != position for label in other}
        tensor, group = _sum_labels(tensor, group, set(group) - elsewhere - set(wanted))
        pending.append((tensor, group))
    result, result_group = pending[0]
    for index in range(1, len(pending)):
        tensor, group = pending[index]
        later = {label for _, other in pending[index + 1 :] for label in other}
        result, result_group = _contract(
            result, result_group, tensor, group, later | set(wanted), sizes
        )
    result, result_group = _sum_labels(result, result_group, set(result_group) - set(wanted))
    return _arranged(result, result_group, wanted, sizes) if wanted else reshape(result, ())


__all__ = ["einsum"]
