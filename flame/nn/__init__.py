"""Neural-network building blocks, written only with public FLAME ops."""

from flame.nn import functional

__all__ = ["functional"]
