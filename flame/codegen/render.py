"""Render a ``KernelSpec`` to CUDA C with the package's Jinja2 templates."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

from flame.codegen.spec import KernelSpec
from flame.records import fields as fields_of

_PACKAGE = Path(__file__).resolve().parent.parent


def template_dir() -> Path:
    """``flame/templates`` in an installed wheel; ``templates/`` beside the package in a
    source checkout."""
    for candidate in (_PACKAGE / "templates", _PACKAGE.parent / "templates"):
        if (candidate / "elementwise.cu.j2").is_file():
            return candidate
    raise FileNotFoundError(f"FLAME's templates are missing (looked in {_PACKAGE}/templates)")


@functools.lru_cache(maxsize=1)
def environment():
    import jinja2  # imported on first render: a warm-cache start never renders

    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(template_dir())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )


def template_names() -> list[str]:
    return sorted(environment().list_templates())


def render(spec: KernelSpec) -> str:
    return environment().get_template(spec.template).render(spec=spec)


def code_key(source: str) -> str:
    """Hash of the code without its leading comment block (IR and user lines): moving a line
    in the user's file must not recompile the kernel."""
    lines = source.splitlines()
    start = 0
    while start < len(lines) and lines[start].startswith("//"):
        start += 1
    return hashlib.sha256("\n".join(lines[start:]).encode()).hexdigest()


@functools.lru_cache(maxsize=1)
def _templates_digest() -> str:
    digest = hashlib.sha256()
    for path in sorted(template_dir().glob("*.j2")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def spec_key(spec: KernelSpec) -> str:
    """A key that identifies the rendered code without rendering it: every field of the spec
    but its comment header, plus the templates' contents. A warm start looks kernels up by
    this key and never loads Jinja2. Kept on the spec (a frozen record: its code cannot
    change) for the plan's later users (the plan store hashes every launch's spec)."""
    known = spec.__dict__.get("_spec_key")
    if known is not None:
        return known
    fields = {f.name: getattr(spec, f.name) for f in fields_of(spec) if f.name != "header"}
    # planned sizes and strides are launch arguments, not code
    fields["params"] = [(arg.kind, arg.ctype, arg.name, arg.operand) for arg in spec.params]
    text = repr(sorted(fields.items())) + _templates_digest()
    key = hashlib.sha256(text.encode()).hexdigest()
    object.__setattr__(spec, "_spec_key", key)
    return key
