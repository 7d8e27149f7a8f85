"""Neural-network building blocks, written only with public FLAME ops."""

from flame.nn import functional, utils

__all__ = ["functional", "utils"]
