"""``Embedding``, as PyTorch's: the same constructor arguments and checks, ``weight``
[num_embeddings, embedding_dim] drawn from N(0, 1) with the ``padding_idx`` row zeroed,
``from_pretrained`` and ``repr``. ``max_norm`` renormalises the looked-up rows of the weight
in place during ``forward`` and ``scale_grad_by_freq`` divides each lookup's gradient by the
count of its index in the batch, as in PyTorch (``flame.nn.embedding``).

Not supported (refused at construction, with the reason): ``sparse=True`` (FLAME's
gradients are dense).
"""

from __future__ import annotations

from flame.nn import init
from flame.nn.functional import embedding
from flame.nn.modules.linear import empty_parameter
from flame.nn.modules.module import Module
from flame.nn.parameter import Parameter
from flame.tensor import Tensor

__all__ = ["Embedding"]


class Embedding(Module):
    """A lookup table: ``forward(indices)`` gives ``weight[indices]``, shape
    ``indices.shape + [embedding_dim]``; the ``padding_idx`` row gets no gradient."""

    __constants__ = [
        "num_embeddings", "embedding_dim", "padding_idx", "max_norm", "norm_type",
        "scale_grad_by_freq", "sparse",
    ]  # fmt: skip

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        _weight: Tensor | None = None,
        _freeze: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if sparse:
            raise NotImplementedError(
                "Embedding: sparse=True is not supported (FLAME's gradients are dense)"
            )
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        if padding_idx is not None:
            if padding_idx > 0:
                if padding_idx >= num_embeddings:
                    raise AssertionError("Padding_idx must be within num_embeddings")
            elif padding_idx < 0:
                if padding_idx < -num_embeddings:
                    raise AssertionError("Padding_idx must be within num_embeddings")
                padding_idx = num_embeddings + padding_idx
        self.padding_idx = padding_idx
        self.max_norm = max_norm
        self.norm_type = norm_type
        self.scale_grad_by_freq = scale_grad_by_freq
        if _weight is None:
            shape = (num_embeddings, embedding_dim)
            self.weight = empty_parameter(shape, device, dtype, requires_grad=not _freeze)
            self.reset_parameters()
        else:
            if list(_weight.shape) != [num_embeddings, embedding_dim]:
                raise AssertionError(
                    "Shape of weight does not match num_embeddings and embedding_dim"
                )
            self.weight = Parameter(_weight, requires_grad=not _freeze)
        self.sparse = sparse

    def reset_parameters(self) -> None:
        init.normal_(self.weight)
        self._fill_padding_idx_with_zero()

    def _fill_padding_idx_with_zero(self) -> None:
        if self.padding_idx is not None:
            init.zeros_(self.weight[self.padding_idx])  # on the weight's backend, no_grad

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002 (PyTorch's name)
        return embedding(
            input, self.weight, self.padding_idx, self.max_norm, self.norm_type,
            self.scale_grad_by_freq, self.sparse,
        )  # fmt: skip

    def extra_repr(self) -> str:
        text = "{num_embeddings}, {embedding_dim}"
        if self.padding_idx is not None:
            text += ", padding_idx={padding_idx}"
        if self.max_norm is not None:
            text += ", max_norm={max_norm}"
        if self.norm_type != 2:
            text += ", norm_type={norm_type}"
        if self.scale_grad_by_freq is not False:
            text += ", scale_grad_by_freq={scale_grad_by_freq}"
        if self.sparse is not False:
            text += ", sparse=True"
        return text.format(**self.__dict__)

    @classmethod
    def from_pretrained(
        cls,
        embeddings: Tensor,
        freeze: bool = True,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
    ) -> Embedding:
        """An ``Embedding`` whose weight is ``embeddings`` [rows, dim] (its memory, shared;
        ``freeze``: no gradient)."""
        if embeddings.ndim != 2:
            raise AssertionError("Embeddings parameter is expected to be 2-dimensional")
        rows, cols = embeddings.shape
        return cls(
            num_embeddings=rows, embedding_dim=cols, _weight=embeddings, _freeze=freeze,
            padding_idx=padding_idx, max_norm=max_norm, norm_type=norm_type,
            scale_grad_by_freq=scale_grad_by_freq, sparse=sparse,
        )  # fmt: skip
