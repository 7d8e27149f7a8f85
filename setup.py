"""Package discovery that pyproject.toml cannot say: every `flame*` package, plus `flame.templates`.

`flame.templates` is the top-level `templates/` directory (mapped in pyproject.toml's
`package-dir`). `packages.find` only finds packages under their parent's directory, so it
cannot list it; everything else about the build lives in pyproject.toml.
"""

from setuptools import find_namespace_packages, setup

PACKAGES = find_namespace_packages(
    include=["flame", "flame.*"],
    exclude=["flame.templates", "flame.templates.*", "*.__pycache__"],
)

setup(packages=[*PACKAGES, "flame.templates"])
