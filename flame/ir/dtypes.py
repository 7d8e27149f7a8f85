"""Data types and the promotion table.

Promotion follows PyTorch:

* categories are ordered ``bool < integer < floating``; a binary op's result takes the higher
  category, and within a category the wider type;
* two types of one width that hold different values give the next wider type: ``float16``
  with ``bfloat16`` gives ``float32``, ``uint8`` with ``int8`` gives ``int16``;
* Python scalars are *weak*: they only raise the category. ``int32_tensor + 2`` stays ``int32``,
  ``int32_tensor + 2.5`` becomes ``float32`` (the default float), ``float16_tensor * 2.0`` stays
  ``float16``;
* zero-dimensional tensors are weak against tensors with dimensions, in the same way:
  ``float16[n] + float32[]`` is ``float16``, ``int32[n] + int64[]`` is ``int32``, and
  ``int32[n] + float16[]`` is ``float16`` (the zero-dimensional tensor's dtype when its category
  is higher). Among tensors of one kind the table below applies (``result_type``).

The table (``a \\ b``, symmetric) for the dtypes FLAME started with. The others fit by
width (``rank``) inside their category: ``int8 = uint8 < int16 < int32 < int64`` and
``float16 = bfloat16 < float32 < float64``. So ``uint8`` with ``int8`` gives ``int16``,
``int8`` with ``int32`` gives ``int32``, ``int16`` with ``float16`` gives ``float16``, and
``float64`` with any dtype gives ``float64`` (tests/test_small_ints.py checks every pair
against ``torch.promote_types``).

| a \\ b      | bool  | int32 | int64 | float16 | bfloat16 | float32 |
| ---------- | ----- | ----- | ----- | ------- | -------- | ------- |
| bool       | bool  | int32 | int64 | float16 | bfloat16 | float32 |
| int32      | int32 | int32 | int64 | float16 | bfloat16 | float32 |
| int64      | int64 | int64 | int64 | float16 | bfloat16 | float32 |
| float16    | f16   | f16   | f16   | float16 | float32  | float32 |
| bfloat16   | bf16  | bf16  | bf16  | float32 | bfloat16 | float32 |
| float32    | f32   | f32   | f32   | float32 | float32  | float32 |

Compute types: 8- and 16-bit integers compute in their own C type (``signed char``, ...), so
every intermediate wraps as PyTorch's does; float16/bfloat16 compute in ``float``; float64
computes in ``double`` (the code generator gives its kernels the double math functions).
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np


@dataclass(frozen=True, eq=False)
class DType:
    """One FLAME dtype: how it is stored, computed and spelled."""

    name: str
    short: str  # printer spelling: f32, bf16, i64, ...
    category: int  # 0 bool, 1 integer, 2 floating
    rank: int  # width order inside the category
    itemsize: int
    numpy: np.dtype  # storage dtype on the host (ml_dtypes for bfloat16)
    c_storage: str  # C type of one element in memory
    c_compute: str  # C type arithmetic runs in (float16/bfloat16 compute in float)

    @property
    def is_float(self) -> bool:
        return self.category == 2

    @property
    def is_int(self) -> bool:
        return self.category == 1

    @property
    def is_bool(self) -> bool:
        return self.category == 0

    @property
    def numpy_compute(self) -> np.dtype:
        """The NumPy dtype arithmetic on this type runs in, as in the kernels (``c_compute``):
        float16/bfloat16 in float32, every other type in itself."""
        return np.dtype(np.float32) if self.c_compute == "float" else self.numpy

    def __repr__(self) -> str:
        return f"flame.{self.name}"

    def __reduce__(self):
        return (dtype, (self.name,))


bool_ = DType("bool", "b8", 0, 0, 1, np.dtype(np.bool_), "bool", "bool")
uint8 = DType("uint8", "u8", 1, 0, 1, np.dtype(np.uint8), "unsigned char", "unsigned char")
int8 = DType("int8", "i8", 1, 0, 1, np.dtype(np.int8), "signed char", "signed char")
int16 = DType("int16", "i16", 1, 1, 2, np.dtype(np.int16), "short", "short")
int32 = DType("int32", "i32", 1, 2, 4, np.dtype(np.int32), "int", "int")
int64 = DType("int64", "i64", 1, 3, 8, np.dtype(np.int64), "long long", "long long")
float16 = DType("float16", "f16", 2, 1, 2, np.dtype(np.float16), "unsigned short", "float")
bfloat16 = DType(
    "bfloat16", "bf16", 2, 1, 2, np.dtype(ml_dtypes.bfloat16), "unsigned short", "float"
)
float32 = DType("float32", "f32", 2, 2, 4, np.dtype(np.float32), "float", "float")
float64 = DType("float64", "f64", 2, 3, 8, np.dtype(np.float64), "double", "double")

ALL = (bool_, uint8, int8, int16, int32, int64, float16, bfloat16, float32, float64)
FLOATS = (float16, bfloat16, float32, float64)
SMALL_INTS = (uint8, int8, int16)  # compute in their own width: every value wraps
DEFAULT_FLOAT = float32
DEFAULT_INT = int64
# two types of one width holding different values promote to this type of the next width
_WIDER = {1: int16, 2: float32}

_BY_NAME = {d.name: d for d in ALL}
_BY_NAME.update(
    {
        "bool_": bool_, "half": float16, "float": float32, "long": int64, "int": int32,
        "double": float64, "short": int16, "char": int8, "byte": uint8,
    }
)  # fmt: skip
_BY_NUMPY = {d.numpy: d for d in ALL}


def dtype(spec) -> DType:
    """Resolve a dtype from a FLAME dtype, a name, a NumPy dtype or a PyTorch dtype."""
    if isinstance(spec, DType):
        return spec
    if isinstance(spec, str):
        found = _BY_NAME.get(spec)
        if found is None:
            raise TypeError(f"unknown dtype {spec!r}; FLAME has {', '.join(d.name for d in ALL)}")
        return found
    torch_name = getattr(spec, "is_floating_point", None) and str(spec)
    if torch_name and torch_name.startswith("torch."):
        return dtype(torch_name[len("torch.") :])
    try:
        found = _BY_NUMPY.get(np.dtype(spec))
    except TypeError:
        found = None
    if found is None:
        raise TypeError(f"unknown dtype {spec!r}; FLAME has {', '.join(d.name for d in ALL)}")
    return found


def promote(a: DType, b: DType) -> DType:
    """Result dtype of a binary op between two tensors (see the module's table)."""
    if a is b:
        return a
    if a.category != b.category:
        return a if a.category > b.category else b
    if a.rank == b.rank:  # float16 vs bfloat16, uint8 vs int8
        return _WIDER[a.category]
    return a if a.rank > b.rank else b


def result_type(dimensioned, zero_dim, scalars) -> DType:
    """PyTorch's result type of an op's operands, in three tiers of decreasing priority:
    tensors with dimensions, zero-dimensional tensors, Python scalars (each tier's dtypes
    promoted by the table). A lower tier decides only when its category is higher."""
    tiers = [None, None, None]
    for tier, members in enumerate((dimensioned, zero_dim, [scalar_dtype(v) for v in scalars])):
        for dtype in members:
            tiers[tier] = dtype if tiers[tier] is None else promote(tiers[tier], dtype)
    result = _combine(tiers[0], _combine(tiers[1], tiers[2]))
    if result is None:
        raise ValueError("result_type: no operands")
    return result


def _combine(higher: DType | None, lower: DType | None) -> DType | None:
    """A tier's dtype with the dtype of the tiers below it (c10's ``combine_categories``)."""
    if higher is None:
        return lower
    if lower is None or higher.is_float:
        return higher
    if higher.is_bool or lower.is_float:
        return promote(higher, lower)
    return higher


def scalar_category(value) -> int:
    if isinstance(value, (bool, np.bool_)):
        return 0
    if isinstance(value, (int, np.integer)):
        return 1
    if isinstance(value, (float, np.floating)):
        return 2
    raise TypeError(f"expected a tensor or a Python number, got {type(value).__name__}")


def promote_scalar(tensor_dtype: DType, value) -> DType:
    """Result dtype of a tensor with a weak Python scalar."""
    category = scalar_category(value)
    if category <= tensor_dtype.category:
        return tensor_dtype
    return DEFAULT_FLOAT if category == 2 else DEFAULT_INT


def scalar_dtype(value) -> DType:
    """The dtype a lone Python scalar gets (``fl.tensor(3.0)``)."""
    return (bool_, DEFAULT_INT, DEFAULT_FLOAT)[scalar_category(value)]
