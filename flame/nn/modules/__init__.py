"""``flame.nn``'s modules, one file per family (module machinery, containers, layers)."""

from flame.nn.modules import (
    activation,
    attention,
    batchnorm,
    conv,
    dropout,
    flatten,
    linear,
    normalization,
    pixelshuffle,
    pooling,
    sparse,
    upsampling,
)
from flame.nn.modules.activation import *  # noqa: F403
from flame.nn.modules.attention import *  # noqa: F403
from flame.nn.modules.batchnorm import *  # noqa: F403
from flame.nn.modules.container import (
    ModuleDict,
    ModuleList,
    ParameterDict,
    ParameterList,
    Sequential,
)
from flame.nn.modules.conv import *  # noqa: F403
from flame.nn.modules.dropout import *  # noqa: F403
from flame.nn.modules.flatten import *  # noqa: F403
from flame.nn.modules.linear import *  # noqa: F403
from flame.nn.modules.module import Module, RemovableHandle
from flame.nn.modules.normalization import *  # noqa: F403
from flame.nn.modules.pixelshuffle import *  # noqa: F403
from flame.nn.modules.pooling import *  # noqa: F403
from flame.nn.modules.sparse import *  # noqa: F403
from flame.nn.modules.upsampling import *  # noqa: F403

__all__ = [
    "Module", "ModuleDict", "ModuleList", "ParameterDict", "ParameterList", "RemovableHandle",
    "Sequential",
    *activation.__all__, *attention.__all__, *batchnorm.__all__, *conv.__all__,
    *dropout.__all__, *flatten.__all__, *linear.__all__, *normalization.__all__,
    *pixelshuffle.__all__, *pooling.__all__, *sparse.__all__, *upsampling.__all__,
]  # fmt: skip
