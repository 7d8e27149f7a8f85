"""Mixed precision: the autocast policy (``flame.autocast``) and ``GradScaler``."""

from flame.amp.autocast_mode import autocast, get_autocast_dtype, is_autocast_enabled
from flame.amp.grad_scaler import GradScaler

__all__ = ["GradScaler", "autocast", "get_autocast_dtype", "is_autocast_enabled"]
