"""``flame.utils``: PyTorch's ``torch.utils`` where FLAME has a counterpart (``data``)."""

from flame.utils import data

__all__ = ["data"]
