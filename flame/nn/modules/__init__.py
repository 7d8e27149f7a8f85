"""``flame.nn``'s modules, one file per family (module machinery, containers, layers)."""

from flame.nn.modules.container import (
    ModuleDict,
    ModuleList,
    ParameterDict,
    ParameterList,
    Sequential,
)
from flame.nn.modules.module import Module, RemovableHandle

__all__ = [
    "Module", "ModuleDict", "ModuleList", "ParameterDict", "ParameterList", "RemovableHandle",
    "Sequential",
]  # fmt: skip
