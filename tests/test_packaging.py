"""The built wheel works away from the repository: templates inside the package, the `flame`
console script, and template rendering from the installed copy.

The wheel is built offline from a copy of the sources (so the checkout gets no `build/` or
`*.egg-info`), installed with `--no-deps` into a fresh venv that borrows this interpreter's
packages (NumPy, Jinja2, ...), and exercised from a directory outside the repository.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SOURCES = ["pyproject.toml", "setup.py", "README.md", "LICENSE", "flame", "templates"]

pytestmark = pytest.mark.slow


def run(command: list[str], cwd: Path) -> subprocess.CompletedProcess:
    environment = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    environment["FLAME_CACHE_DIR"] = str(cwd / "flame-cache")
    environment["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    result = subprocess.run(
        command, cwd=cwd, env=environment, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, f"{command} failed:\n{result.stdout}\n{result.stderr}"
    return result


def setuptools_builds_offline() -> bool:
    """setuptools >= 70.1 builds wheels by itself; older ones need `wheel` from the network."""
    try:
        version = importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:
        return False
    major, minor = (int(part) for part in version.split(".")[:2])
    return (major, minor) >= (70, 1)


def copy_sources(destination: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "dist")
    destination.mkdir(parents=True)
    for name in SOURCES:
        source = REPO_ROOT / name
        if source.is_dir():
            shutil.copytree(source, destination / name, ignore=ignore)
        elif source.exists():
            shutil.copy2(source, destination / name)


def build_wheel(work: Path) -> Path:
    source = work / "source"
    copy_sources(source)
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(work / "dist")]
    if setuptools_builds_offline():
        command.append("--no-build-isolation")
    run([*command, str(source)], cwd=work)
    (wheel,) = (work / "dist").glob("flame-*.whl")
    return wheel


def make_venv(work: Path) -> Path:
    """A fresh venv that sees the packages of the interpreter running the tests.

    `--system-site-packages` alone sees the *base* interpreter's, which misses everything when
    the tests run inside a venv (as in CI); a .pth line adds this interpreter's too. Lines of a
    .pth only extend sys.path, so an editable install of FLAME found there stays inactive.
    """
    directory = work / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=True).create(directory)
    python = directory / "bin" / "python"
    site_packages = run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], cwd=work
    ).stdout.strip()
    host_paths = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    Path(site_packages, "flame-test-host.pth").write_text("\n".join(sorted(host_paths)) + "\n")
    return python


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(wheel, venv python, a working directory outside the repository)."""
    work = tmp_path_factory.mktemp("packaging")
    wheel = build_wheel(work)
    python = make_venv(work)
    run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)], cwd=work)
    outside = work / "elsewhere"
    outside.mkdir()
    return wheel, python, outside


def test_wheel_holds_package_and_templates_only(installed):
    wheel, _, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    for template in (REPO_ROOT / "templates").glob("*.j2"):
        assert f"flame/templates/{template.name}" in names
    for module in ["_version.py", "__main__.py", "runtime/cache.py", "tools/cli.py"]:
        assert f"flame/{module}" in names
    top_level = {name.split("/")[0] for name in names}
    assert top_level == {"flame", "flame-0.1.0.dist-info"}, "wheel ships more than the package"


def test_installed_package_finds_its_templates(installed):
    _, python, outside = installed
    probe = (
        "import importlib.resources, flame; "
        "print(flame.__file__); "
        "templates = importlib.resources.files('flame') / 'templates'; "
        "print(*sorted(entry.name for entry in templates.iterdir()))"
    )
    location, names = run([str(python), "-c", probe], cwd=outside).stdout.splitlines()
    assert not Path(location).is_relative_to(REPO_ROOT), "imported the checkout, not the wheel"
    assert "elementwise.cu.j2" in names.split()


def test_console_script_runs(installed):
    _, python, outside = installed
    result = run([str(python.parent / "flame"), "--version"], cwd=outside)
    assert result.stdout.strip() == "flame 0.1.0"
    info = run([str(python.parent / "flame"), "info"], cwd=outside)
    assert str(outside / "flame-cache") in info.stdout


def test_installed_templates_render(installed):
    if not (REPO_ROOT / "flame" / "codegen" / "render.py").exists():
        pytest.skip("flame/codegen/render.py does not exist yet (core engineer's file)")
    _, python, outside = installed
    probe = "import flame.codegen.render as render; print(render.template_names())"
    result = run([str(python), "-c", probe], cwd=outside)
    assert "elementwise" in result.stdout
