"""The op registry: every op is declared once, here or in a sibling module, with ``def_op``.

A declaration holds everything the rest of FLAME needs to know about an op:

* ``kind``: ``elementwise`` (fusible, one value per element), ``leaf`` (no tensor inputs:
  buffers, constants, random numbers, iota), ``movement`` (an index map, no arithmetic),
  ``reduce`` (combines values along axes) or ``library`` (runs a library or hand-written
  kernel named by the op, e.g. cuBLAS for matmul; see ``flame/runtime/library.py``);
* ``shape_rule(inputs, attrs) -> (dtype, shape)`` for every kind but elementwise (whose rule
  is shared: one shape, declared promotion); it raises ShapeError/TypeError naming the op;
* the dtype rule: ``promotion`` (how the tensor layer casts inputs before building the node),
  ``categories`` (which input kinds are allowed), ``out_bool`` (comparisons);
* ``ref``: the NumPy reference, called on arrays in compute precision (float16/bfloat16
  arrive as float32, the oracle may pass float64);
* ``cuda``: one C expression per input category (``f``, ``i``, ``b``), ``{0}``, ``{1}`` for the
  inputs and ``{name}`` for attributes; ``helpers`` names the C helper functions it needs.
  An optional ``f16`` expression is used instead of ``f`` where the result is float16 or
  bfloat16: it may trade float32 accuracy for instructions (hardware approximations) where
  its error stays far below a 16-bit ulp (2^-11 relative) for values of order one, and no
  larger than the ``f`` expression's elsewhere;
* ``vjp``: the backward rule (filled by the autograd work; ``None`` until then), and
  ``differentiable=False`` for ops that have no gradient;
* the sample inputs the registry-driven tests use (``domains``, ``attr_samples``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

OPS: dict[str, OpDef] = {}
HELPERS: dict[str, str] = {}

CATEGORY_LETTER = {0: "b", 1: "i", 2: "f"}


@dataclass(frozen=True)
class OpDef:
    name: str
    kind: str
    arity: int
    ref: Callable[..., Any] | None = None
    cuda: Mapping[str, str] = field(default_factory=dict)
    promotion: str = "default"  # default | int_to_float | always_bool | none
    categories: str = "bif"
    out_bool: bool = False
    helpers: tuple[str, ...] = ()
    attrs: Mapping[str, Any] = field(default_factory=dict)  # attribute names and defaults
    shape_rule: Callable[..., Any] | None = None
    vjp: Callable[..., Any] | None = None
    differentiable: bool = True
    domains: tuple[tuple, ...] = ()
    attr_samples: tuple[Mapping[str, Any], ...] = ({},)
    doc: str = ""
    internal: bool = False  # built by FLAME itself (autograd), not by users: not in op tables

    def expression(self, category: int, narrow: bool = False) -> str:
        """The C expression for inputs of ``category``; ``narrow``: the result is a 16-bit
        float, so the ``f16`` expression is taken where there is one."""
        letter = CATEGORY_LETTER[category]
        if narrow and letter == "f" and "f16" in self.cuda:
            return self.cuda["f16"]
        expression = self.cuda.get(letter)
        if expression is None:
            raise KeyError(f"{self.name} has no CUDA expression for category {letter!r}")
        return expression

    def accepts(self, category: int) -> bool:
        return CATEGORY_LETTER[category] in self.categories


def def_op(name: str, kind: str, arity: int, **fields) -> OpDef:
    if name in OPS:
        raise ValueError(f"op {name!r} is declared twice")
    op = OpDef(name=name, kind=kind, arity=arity, **fields)
    OPS[name] = op
    return op


def def_helper(name: str, source: str) -> None:
    """A C helper function some ops' expressions call; emitted once per kernel that needs it."""
    HELPERS[name] = source.strip() + "\n"


def def_vjp(name: str, rule) -> None:
    """Attach the backward rule of an op, right after its declaration (JAX style).

    ``rule(F, g, out, *inputs, **attrs)`` returns one cotangent per input (None: no
    gradient). ``F`` is the namespace of differentiable functions in flame/grad_functions.py,
    so rules are written with ordinary tensor ops and their results are IR like everything
    else."""
    import dataclasses

    OPS[name] = dataclasses.replace(OPS[name], vjp=rule)


def get_op(name: str) -> OpDef:
    try:
        return OPS[name]
    except KeyError:
        raise KeyError(f"unknown op {name!r}") from None


def elementwise_ops() -> list[OpDef]:
    """The user-facing elementwise ops (the registry-driven tests iterate these)."""
    return [op for op in OPS.values() if op.kind == "elementwise" and not op.internal]
