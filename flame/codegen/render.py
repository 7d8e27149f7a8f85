"""Render a ``KernelSpec`` to CUDA C with the package's Jinja2 templates."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import jinja2

from flame.codegen.spec import KernelSpec

_PACKAGE = Path(__file__).resolve().parent.parent


def template_dir() -> Path:
    """``flame/templates`` in an installed wheel; ``templates/`` beside the package in a
    source checkout."""
    for candidate in (_PACKAGE / "templates", _PACKAGE.parent / "templates"):
        if (candidate / "elementwise.cu.j2").is_file():
            return candidate
    raise FileNotFoundError(f"FLAME's templates are missing (looked in {_PACKAGE}/templates)")


@functools.lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
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
