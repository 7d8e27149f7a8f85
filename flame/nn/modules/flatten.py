"""``Flatten`` and ``Unflatten``: PyTorch's arguments and ``repr``, forward is the tensor's own
``flatten`` / ``unflatten`` (views: no kernel of their own)."""

from __future__ import annotations

from flame.nn.modules.module import Module
from flame.tensor import Tensor

__all__ = ["Flatten", "Unflatten"]


class Flatten(Module):
    """Merge dims ``start_dim`` .. ``end_dim`` (by default all but the batch dim) into one."""

    def __init__(self, start_dim: int = 1, end_dim: int = -1) -> None:
        super().__init__()
        self.start_dim = start_dim
        self.end_dim = end_dim

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002
        return input.flatten(self.start_dim, self.end_dim)

    def extra_repr(self) -> str:
        return f"start_dim={self.start_dim}, end_dim={self.end_dim}"


class Unflatten(Module):
    """Split dim ``dim`` into ``unflattened_size`` (a tuple or list of ints, one may be -1)."""

    def __init__(self, dim: int, unflattened_size) -> None:
        super().__init__()
        _require_tuple_int(unflattened_size)
        self.dim = dim
        self.unflattened_size = unflattened_size

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002
        return input.unflatten(self.dim, self.unflattened_size)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, unflattened_size={self.unflattened_size}"


def _require_tuple_int(sizes) -> None:
    if isinstance(sizes, (tuple, list)):
        for position, item in enumerate(sizes):
            if not isinstance(item, int):
                raise TypeError(
                    "unflattened_size must be tuple of ints, "
                    f"but found element of type {type(item).__name__} at pos {position}"
                )
        return
    raise TypeError(
        f"unflattened_size must be a tuple of ints, but found type {type(sizes).__name__}"
    )
