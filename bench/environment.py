"""What this machine has: compile caches, the GPU, library versions. Standard library at the top:
callers import this before torch, CuPy or FLAME are loaded."""

import contextlib
import importlib
import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# Every compiler cache a peer or FLAME reads. Pointing them at empty folders makes "first call"
# mean a real compile for everyone, whatever earlier runs on this machine left behind.
CACHE_VARIABLES = {
    "FLAME_CACHE_DIR": "flame",
    "CUPY_CACHE_DIR": "cupy",
    "TORCHINDUCTOR_CACHE_DIR": "torchinductor",
    "TRITON_CACHE_DIR": "triton",
}

REPOSITORY_ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def scratch_directory(isolate_caches: bool):
    """A temporary folder for the run; with ``isolate_caches``, every compile cache lives in it."""
    root = Path(tempfile.mkdtemp(prefix="flame-bench-"))
    saved = {name: os.environ.get(name) for name in CACHE_VARIABLES}
    try:
        if isolate_caches:
            for name, folder in CACHE_VARIABLES.items():
                os.environ[name] = str(root / "caches" / folder)
        yield root
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        shutil.rmtree(root, ignore_errors=True)


BYTECODE_WARM_UP = """
import compileall, pathlib, sys
import flame
compileall.compile_dir(pathlib.Path(flame.__file__).parent, quiet=1)
from flame.codegen import render
for name in render.template_names():
    render.environment().get_template(name)
try:
    import cupy
    from cupy._core import fusion
except ImportError:
    pass
if sys.argv[1] == "torch":
    try:
        import torch._dynamo, torch._inductor.compile_fx
    except ImportError:
        pass
"""


def warm_python_bytecode(scratch: Path, with_torch: bool) -> None:
    """Python's bytecode, as an installed package has it, for this process's imports.

    Some machines set PYTHONDONTWRITEBYTECODE and ship site-packages without bytecode; there
    every module imported during a timed first call (Jinja2 on the first render, FLAME's own
    code generator, torch.compile's Inductor) would be compiled from source inside the timing
    (measured: 139 ms of Jinja2 alone in FLAME's first call). A throwaway process writes the
    bytecode to a folder in the scratch directory (compile caches untouched), and this process
    reads it from there: ``flame_only``'s new-process timings use the same folder."""
    prefix = scratch / "pycache"
    variables = dict(os.environ, PYTHONPYCACHEPREFIX=str(prefix))
    variables.pop("PYTHONDONTWRITEBYTECODE", None)
    variables["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(REPOSITORY_ROOT), variables.get("PYTHONPATH")])
    )
    code = [sys.executable, "-c", BYTECODE_WARM_UP, "torch" if with_torch else "no-torch"]
    subprocess.run(code, env=variables, cwd=REPOSITORY_ROOT, timeout=600, check=False)
    sys.pycache_prefix = str(prefix)
    sys.dont_write_bytecode = False


def probe_gpu() -> tuple[dict | None, str | None]:
    """(facts about GPU 0, None) or (None, why there is none)."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            return cupy_gpu_facts(cupy), None
        reason = "no GPU (CuPy sees 0 devices)"
    except Exception as error:  # no driver raises here, which is the normal case on CPU machines
        reason = f"no GPU ({type(error).__name__}: {error})"
    try:
        import torch

        if torch.cuda.is_available():
            properties = torch.cuda.get_device_properties(0)
            facts = {"name": properties.name, "multiprocessors": properties.multi_processor_count}
            return facts, None
    except Exception:
        pass
    return None, reason


def cupy_gpu_facts(cupy) -> dict:
    runtime = cupy.cuda.runtime
    properties = runtime.getDeviceProperties(0)
    name = properties["name"]
    facts = {
        "name": name.decode() if isinstance(name, bytes) else name,
        "compute_capability": f"{properties['major']}.{properties['minor']}",
        "multiprocessors": properties["multiProcessorCount"],
        "memory_gib": round(properties["totalGlobalMem"] / 2**30, 1),
        "l2_mib": round(properties["l2CacheSize"] / 2**20, 1),
        "cuda_runtime": runtime.runtimeGetVersion(),
        "cuda_driver": runtime.driverGetVersion(),
    }
    with contextlib.suppress(Exception):
        from cupy_backends.cuda.libs import nvrtc

        facts["nvrtc"] = ".".join(str(part) for part in nvrtc.getVersion())
    return facts


def library_versions() -> dict:
    """Versions of everything that takes part, or why it could not be imported."""
    versions = {"python": platform.python_version(), "executable": sys.executable}
    for name in ("flame", "torch", "cupy", "numpy"):
        try:
            module = importlib.import_module(name)
            versions[name] = getattr(module, "__version__", "unknown")
        except Exception as error:
            versions[name] = f"not importable ({type(error).__name__}: {error})"
    # Read from the installed metadata: importing JAX would start its own GPU runtime.
    for name in ("triton", "jax"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions
