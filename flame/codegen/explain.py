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
    # within one class the code should not change with sizes: say where it did (the first
    # line that differs often holds the size, e.g. a literal offset)
    first = spec_differences(earlier, spec)[:1]
    detail = f" (first: {first[0]})" if first else ""
    return f"same size class {spec.size_class!r}; changed: {', '.join(changed)}{detail}"


def _short(value, limit: int = 100) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _first_difference(a, b, path: str) -> str:
    """Where two values first differ, e.g. ``extras['block']: 256 != 512``."""
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        for index, (left, right) in enumerate(zip(a, b)):
            if left != right:
                return _first_difference(left, right, f"{path}[{index}]")
        return f"{path}: length {len(a)} != {len(b)}"
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            left, right = a.get(key, "<absent>"), b.get(key, "<absent>")
            if left != right:
                return _first_difference(left, right, f"{path}[{key!r}]")
    return f"{path}: {_short(a)} != {_short(b)}"


def spec_differences(spec, other) -> list[str]:
    """Each part of two specs' code that differs (``extras`` key by key), with where inside
    it: what a compile's reason names in detail (the probes and the tests print it)."""
    lines = []
    for name in [f.name for f in fields(spec) if f.name not in ("name", "header")]:
        left, right = _code(spec, name), _code(other, name)
        if left == right:
            continue
        if isinstance(left, dict) and isinstance(right, dict):
            for key in sorted(set(left) | set(right), key=str):
                a, b = left.get(key, "<absent>"), right.get(key, "<absent>")
                if a != b:
                    lines.append(_first_difference(a, b, f"{name}[{key!r}]"))
        else:
            lines.append(_first_difference(left, right, name))
    return lines
