"""FLAME: a JIT graph compiler for deep-learning training on NVIDIA GPUs.

Tensor ops build a lazy IR graph; realizing a tensor fuses the graph into kernels, renders
them as CUDA C, compiles them with NVRTC (cached in memory and on disk) and runs them.
"""

from flame import (
    backends,  # noqa: F401  (flame.backends.cudnn.enabled, as torch.backends)
    devices,  # noqa: F401  (x.device, x.to(device), x.cpu(), x.cuda())
    dtype_views,  # noqa: F401  (Tensor.double/byte/char/short/type)
    func,  # noqa: F401  (flame.func.grad/vjp/grad_and_value, as torch.func)
    inplace_ops,  # noqa: F401  (add_, copy_, e += p, x[i] = v, ...)
    interop,  # noqa: F401  (data_ptr, __dlpack__, __cuda_array_interface__)
    nn,  # noqa: E402  (after the tensor methods it uses exist)
    optim,  # noqa: E402  (written with the public ops above)
    utils,  # noqa: F401  (fl.utils.data.DistributedSampler, as torch.utils.data)
)
from flame._version import __version__
from flame.amp import autocast, get_autocast_dtype, is_autocast_enabled
from flame.autograd import (
    GradError,
    enable_grad,
    grad,
    inference_mode,
    is_grad_enabled,
    no_grad,
)  # fmt: skip
from flame.backend import backend, get_backend, synchronize
from flame.compile import TraceError, compile  # noqa: A004 (flame.compile, as torch.compile)
from flame.contraction import einsum
from flame.creation import (
    arange,
    bernoulli,
    empty,
    empty_like,
    from_dlpack,
    from_numpy,
    full,
    full_like,
    multinomial,
    normal,
    ones,
    ones_like,
    rand,
    rand_like,
    randint,
    randint_like,
    randn,
    randn_like,
    randperm,
    tensor,
    zeros,
    zeros_like,
)  # fmt: skip
from flame.determinism import are_deterministic_algorithms_enabled, use_deterministic_algorithms
from flame.devices import device
from flame.foreach import ForeachError, foreach
from flame.func import value_and_grad, vjp
from flame.functional import *  # noqa: F403
from flame.functional import __all__ as _functional_names
from flame.functional import clamp
from flame.indexing import (
    embedding,
    gather,
    index_add,
    index_select,
    index_tensor,
    masked_fill,
    masked_select,
    nonzero,
    one_hot,
    scatter,
    scatter_add,
    scatter_reduce,
    take_along_dim,
)  # fmt: skip
from flame.io import load_file, save_file
from flame.ir.dtypes import (
    DType,
    bfloat16,
    bool_,
    float16,
    float32,
    float64,
    int8,
    int16,
    int32,
    int64,
    uint8,
)  # fmt: skip
from flame.ir.dtypes import (
    promote as promote_types,
)
from flame.ir.shapes import ShapeError
from flame.joining import cat, pad, repeat, stack, tril, triu
from flame.linalg import (
    addmm,
    baddbmm,
    bmm,
    cross,
    get_matmul_precision,
    matmul,
    matmul_precision,
    set_matmul_precision,
)  # fmt: skip
from flame.norms import allclose, isclose, norm
from flame.random import (
    Generator,
    default_generator,
    get_rng_state,
    initial_seed,
    manual_seed,
    seed,
    set_rng_state,
)  # fmt: skip
from flame.ranges import eye, linspace, logspace, tril_indices, triu_indices
from flame.rearranging import adjoint, diff, ravel, rot90, swapaxes, swapdims, t, tile
from flame.recompute import checkpoint
from flame.reductions import (
    all,
    amax,
    amin,
    aminmax,
    any,
    argmax,
    argmin,
    count_nonzero,
    logsumexp,
    max,
    mean,
    min,
    std,
    std_mean,
    sum,
    var,
    var_mean,
)  # fmt: skip
from flame.reductions import (
    prod_ as prod,
)
from flame.scan import cummax, cummin, cumprod, cumsum, logcumsumexp
from flame.shaping import (
    chunk,
    clone,
    diag,
    diagonal,
    meshgrid,
    moveaxis,
    movedim,
    outer,
    repeat_interleave,
    roll,
    split,
    unbind,
    unflatten,
)  # fmt: skip
from flame.sorting import argsort, msort, sort, topk
from flame.tensor import Tensor, realize
from flame.tools.debug import activate_from_environment as _activate_dump
from flame.tools.debug import dump
from flame.views import (
    broadcast_to,
    expand,
    flatten,
    flip,
    narrow,
    permute,
    reshape,
    squeeze,
    transpose,
    unsqueeze,
)  # fmt: skip

half = float16
double = float64
short = int16
float = float32  # noqa: A001 (PyTorch's spelling: flame.float)
long = int64
int = int32  # noqa: A001
bool = bool_  # noqa: A001

_activate_dump()  # FLAME_DUMP=DIR: record this program, write the dump at exit

__all__ = [
    "DType", "ShapeError", "Tensor", "__version__", "arange", "backend", "bfloat16", "bool_",
    "are_deterministic_algorithms_enabled", "use_deterministic_algorithms",
    "clamp", "float16", "float32", "from_dlpack", "from_numpy", "full", "full_like",
    "get_backend", "int32", "int64", "ones", "ones_like", "promote_types", "rand", "rand_like",
    "randn", "randn_like", "realize", "synchronize", "tensor", "zeros", "zeros_like",
    "all", "amax", "amin", "any", "argmax", "argmin", "bernoulli", "broadcast_to", "cat",
    "pad", "repeat", "stack", "tril", "triu", "GradError", "checkpoint", "enable_grad", "grad",
    "is_grad_enabled", "no_grad", "value_and_grad", "vjp", "bmm", "compile", "TraceError",
    "get_matmul_precision", "matmul",
    "matmul_precision", "set_matmul_precision", "embedding", "gather", "index_select",
    "index_tensor", "masked_fill", "one_hot", "scatter_add", "take_along_dim", "expand", "flatten",
    "flip", "logsumexp", "max", "mean", "min", "narrow", "nn", "permute", "prod", "reshape",
    "squeeze", "std", "sum", "transpose", "unsqueeze", "var", "foreach", "ForeachError",
    "optim", "func", "dump", "inference_mode", "scatter", "scatter_reduce", "nonzero",
    "masked_select", "empty", "empty_like", "device", "double", "float64", "int8", "int16",
    "short", "uint8", "einsum", "allclose", "isclose", "norm", "eye", "linspace", "logspace",
    "tril_indices", "triu_indices", "cummax", "cummin", "cumprod", "cumsum", "logcumsumexp",
    "chunk", "clone", "diag", "diagonal", "meshgrid", "moveaxis", "movedim", "outer",
    "repeat_interleave", "roll", "split", "unbind", "unflatten", "argsort", "msort", "sort",
    "topk", "Generator", "default_generator", "get_rng_state", "initial_seed",
    "manual_seed", "seed", "set_rng_state", "multinomial", "normal", "randint", "randint_like",
    "randperm", "load_file", "save_file",
    "autocast", "get_autocast_dtype", "is_autocast_enabled",
    "addmm", "adjoint", "aminmax", "baddbmm", "count_nonzero", "cross", "diff", "index_add",
    "ravel", "rot90", "std_mean", "swapaxes", "swapdims", "t", "tile", "var_mean",
    *_functional_names,
]  # fmt: skip
