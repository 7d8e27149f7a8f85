"""``KernelSpec``: everything a template needs, as plain data.

The lowering (``flame.codegen.elementwise``) decides types, index maps and statements; the
template only lays them out. The spec holds no sizes: sizes and strides are kernel arguments,
described by ``Arg`` records that the runtime fills in at launch.
"""

from __future__ import annotations

import math

from flame.ir.dtypes import DType
from flame.records import Record, field


class Arg(Record, frozen=True):
    """One kernel parameter: ``kind`` is ``out`` / ``in`` (a buffer) or ``size`` / ``stride``
    (an integer the launcher computes from the shapes it was planned for)."""

    kind: str
    ctype: str
    name: str
    value: int = 0  # for size/stride: the planned value
    operand: int = -1  # for in/out: position in Lowered.reads / group outputs


class KernelSpec(Record, frozen=True):
    """What a template renders: the kernel's name, launch shape, parameters and code lines."""

    name: str
    template: str
    index_type: str
    vec: int
    block: int
    params: tuple[Arg, ...]
    header: tuple[str, ...]  # comment lines: the IR group and the user's lines
    helpers: tuple[str, ...]  # C helper function sources
    setup: tuple[str, ...]  # once per thread, before the loop
    prologue: tuple[str, ...]  # once per vector: index math, vector loads
    body: tuple[str, ...]  # once per lane k of the vector
    epilogue: tuple[str, ...]  # once per vector: vector stores
    tail: tuple[str, ...] = ()  # scalar loop body for the last n % vec elements
    count: str = "n"  # C expression: loop trip count in vectors
    extras: dict = field(default_factory=dict)
    # the sizes this code serves, named (e.g. "vec4 rows<=4096 i32"): code changes with sizes
    # only between classes, never within one; the dump and compile explanations show it
    size_class: str = ""


def c_literal(value, dtype: DType) -> str:
    """A C literal of ``value`` in ``dtype``'s compute type (exact for float32 and float64)."""
    if dtype.is_bool:
        return "true" if value else "false"
    if dtype.is_int:
        suffix = "LL" if dtype.itemsize == 8 else ""
        return f"{int(value)}{suffix}"
    return float_literal(value, double=dtype.c_compute == "double")


def float_literal(value, double: bool = False) -> str:
    """A float literal (rounded to float32), or a double one with ``double``."""
    import numpy as np

    value = float(value) if double else float(np.float32(value))
    if math.isnan(value):
        if double:
            return "__longlong_as_double(0x7ff8000000000000LL)"
        return "__int_as_float(0x7fffffff)"
    if math.isinf(value):
        if double:
            bits = "0x7ff0000000000000LL" if value > 0 else "0xfff0000000000000LL"
            return f"__longlong_as_double({bits})"
        return "__int_as_float(0x7f800000)" if value > 0 else "__int_as_float(0xff800000)"
    return repr(value) if double else f"{value!r}f"
