"""Why a kernel had to be compiled: which part of its key changed.

A kernel's code follows its op structure, dtypes, broadcast pattern, layout and size class
(``KernelSpec.size_class``), never sizes themselves. When a plan needs a kernel the process
has not loaded, ``compile_reason`` compares its spec with the last kernel of the same
operations (the same name stem) and names what differs: a new size class, or the parts of
the code that changed within one. The dump and ``cache_info()`` show it for every compile.
"""

from __future__ import annotations

from flame.records import fields

_SKIPPED = ("name", "header", "size_class")


def stem(name: str) -> str:
    """A kernel's name without its code digest: the operations it runs."""
    return name.rsplit("_", 1)[0]


def _code(spec, name: str):
    value = getattr(spec, name)
    if name == "params":  # sizes and strides are arguments: their values are not code
        return tuple((arg.kind, arg.ctype, arg.name) for arg in value)
    return value


def changed_fields(spec, other) -> list[str]:
    """The parts of two specs' code that differ (sizes excluded)."""
    names = [f.name for f in fields(spec) if f.name not in _SKIPPED]
    return [name for name in names if _code(spec, name) != _code(other, name)]


def compile_reason(spec, earlier) -> str:
    """Why ``spec`` is new code, given ``earlier``: the last spec of the same operations this
    process loaded (None: none)."""
    if earlier is None:
        return "first kernel of these operations in this process"
    changed = changed_fields(spec, earlier)
    if spec.size_class != earlier.size_class:
        return f"size class {earlier.size_class!r} -> {spec.size_class!r}" + (
            f" (changed: {', '.join(changed)})" if changed else ""
        )
    if not changed:
        return "the same code as the last kernel of these operations (not in the cache)"
    return f"same size class {spec.size_class!r}; changed: {', '.join(changed)}"
