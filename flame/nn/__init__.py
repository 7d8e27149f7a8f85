"""Neural-network building blocks, written only with public FLAME ops: ``Module`` and the
layers (``flame/nn/modules/``), ``functional``, ``init``, ``utils``."""

from flame.nn import functional, init, parallel, utils
from flame.nn.modules import *  # noqa: F403
from flame.nn.modules import __all__ as _module_names
from flame.nn.parameter import Buffer, Parameter

__all__ = ["Buffer", "Parameter", "functional", "init", "parallel", "utils", *_module_names]
