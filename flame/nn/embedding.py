"""``embedding`` with PyTorch's ``torch.nn.functional.embedding`` signature: the lookup
(``flame.indexing.embedding``: ``padding_idx``, ``scale_grad_by_freq``) after PyTorch's
``max_norm`` renormalisation, which rescales the referenced rows of ``weight`` in place,
without gradient (``embedding_renorm_``).

The renormalisation is lazy and needs no sync: the referenced rows' norms come from one
gather, each row's factor (``max_norm / (norm + 1e-7)`` where the norm exceeds
``max_norm``, computed in float64 as PyTorch's) is scattered by ``amin`` into a column of
ones (a repeated index carries the same factor), and the whole weight is multiplied by it
and written back. Rows that are not referenced are multiplied by 1, so they keep their
bits; the price is one pass over the whole table per lookup with ``max_norm``.
"""

from __future__ import annotations

from flame import creation
from flame.autograd import no_grad
from flame.backend import backend as use_backend
from flame.functional import where
from flame.indexing import embedding as lookup
from flame.indexing import scatter_reduce
from flame.ir import dtypes
from flame.norms import vector_norm
from flame.shaping import checked_tensor, shown, user_errors
from flame.tensor import Tensor
from flame.views import reshape

__all__ = ["embedding", "renormed"]


def renormed(weight: Tensor, input: Tensor, max_norm: float, norm_type: float) -> Tensor:  # noqa: A002
    """``weight`` with each row named in ``input`` whose ``norm_type``-norm exceeds
    ``max_norm`` scaled to norm ``max_norm`` (the value ``embedding_renorm_`` writes)."""
    rows = reshape(input, (input.numel(),))
    with use_backend(weight.backend):
        norms = vector_norm(lookup(rows, weight), ord=norm_type, dim=1).to(dtypes.float64)
        factors = where(norms > max_norm, max_norm / (norms + 1e-7), 1.0).to(weight.dtype)
        ones = creation.ones((weight.shape[0],), dtype=weight.dtype)
        per_row = scatter_reduce(ones, 0, rows, factors, "amin")
        return weight * reshape(per_row, (weight.shape[0], 1))


@user_errors
def embedding(
    input: Tensor,  # noqa: A002 (PyTorch's name)
    weight: Tensor,
    padding_idx: int | None = None,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
) -> Tensor:
    """Rows of ``weight [num_embeddings, dim]`` named by the integer ``input``, shape
    ``input.shape + [dim]``. ``max_norm``: first renormalise, in place, the rows ``input``
    names whose ``norm_type``-norm exceeds it. ``sparse=True`` is refused (FLAME's
    gradients are dense)."""
    checked_tensor("embedding", input)
    checked_tensor("embedding", weight)
    if sparse:
        raise NotImplementedError(
            "embedding: sparse=True is not supported (FLAME's gradients are dense)"
        )
    if max_norm is not None:
        if weight.ndim != 2:
            raise ValueError(
                f"embedding: max_norm needs a 2-d weight [num_embeddings, dim], got weight "
                f"{shown(weight)}"
            )
        with no_grad():
            weight.copy_(renormed(weight, input, float(max_norm), float(norm_type)))
    return lookup(input, weight, padding_idx, scale_grad_by_freq)
