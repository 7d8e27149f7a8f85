"""The `flame` command: `flame --version`, `flame info`, `flame cache list|size|clear`,
`flame dump`, `flame check`, `flame run`.

Everything here works on a machine without a GPU, and `--version` without CuPy: heavy or
optional modules are imported inside the command that needs them, never at the top.
Each subcommand is one `_add_<name>` function (its arguments) and one `_run_<name>` (its work);
new tools (`dump`, `check`, `bench`) plug into `_SUBCOMMANDS` the same way.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
from collections.abc import Callable
from pathlib import Path

from flame._version import __version__


def main(argv: list[str] | None = None) -> int:
    """Run the `flame` command with `argv` (default: `sys.argv[1:]`); return the exit status."""
    parser = _build_parser()
    arguments = parser.parse_args(argv)
    if not hasattr(arguments, "run"):
        parser.print_help()
        return 0
    try:
        return arguments.run(arguments)
    except BrokenPipeError:
        # `flame cache list | head` closes the pipe early; that is not an error.
        sys.stderr.close()
        return 0


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flame", description="FLAME: a JIT graph compiler for deep-learning training."
    )
    parser.add_argument("--version", action="version", version=f"flame {__version__}")
    subcommands = parser.add_subparsers(title="commands", metavar="COMMAND")
    for add_subcommand in _SUBCOMMANDS:
        add_subcommand(subcommands)
    return parser


# -- flame info -------------------------------------------------------------------------------


def _add_info(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "info", help="versions, GPU, NVRTC and cache: what to paste into a bug report"
    )
    parser.set_defaults(run=_run_info)


def _run_info(arguments: argparse.Namespace) -> int:
    rows = [
        ("flame", __version__),
        ("python", f"{platform.python_version()} ({sys.executable})"),
        ("platform", platform.platform()),
        ("numpy", _module_version("numpy")),
    ]
    rows += _cuda_rows()
    rows += _library_rows()
    rows += _cache_rows(None)
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return 0


def _library_rows() -> list[tuple[str, str]]:
    """Which path convolutions and attention take: cuDNN, or FLAME's own kernels and why;
    and whether NCCL (flame.distributed's nccl backend) can be loaded."""
    return _cudnn_rows() + [("nccl", _nccl_status())]


def _nccl_status() -> str:
    try:
        from flame.runtime import library_nccl

        return library_nccl.status()
    except Exception as error:  # a broken install should be reported, not crash `info`
        return f"unavailable ({type(error).__name__}: {error})"


def _cudnn_rows() -> list[tuple[str, str]]:
    try:
        from flame.runtime import library_cudnn

        status = library_cudnn.status()
    except Exception as error:  # a broken install should be reported, not crash `info`
        return [("cudnn", f"unavailable ({type(error).__name__}: {error})")]
    if status.available:
        path = f"{status.version} (frontend {status.frontend}): convolution and attention"
        return [("cudnn", path)]
    return [
        ("cudnn", f"not used: {status.reason}"),
        ("convolution", "FLAME's im2col fallback (CuPy + cuBLAS)"),
        ("attention", "FLAME's flash-attention kernel"),
    ]


def _module_version(name: str) -> str:
    try:
        module = __import__(name)
    except Exception as error:  # a broken install should be reported, not crash `info`
        return _not_installed(error)
    return str(getattr(module, "__version__", "unknown version"))


def _not_installed(error: Exception) -> str:
    if isinstance(error, ModuleNotFoundError):
        return "not installed"
    return f"unavailable ({type(error).__name__}: {error})"


def _cuda_rows() -> list[tuple[str, str]]:
    try:
        import cupy
    except Exception as error:
        reason = _not_installed(error)
        return [("cupy", reason), ("nvrtc", f"unavailable (cupy {reason})"), ("gpu", "unknown")]
    runtime = cupy.cuda.runtime
    return [
        ("cupy", str(cupy.__version__)),
        ("nvrtc", _nvrtc_version(cupy)),
        ("cuda runtime", _call_or_reason(lambda: _cuda_version(runtime.runtimeGetVersion()))),
        ("cuda driver", _driver_version(runtime)),
        *_gpu_rows(runtime),
    ]


def _nvrtc_version(cupy) -> str:
    def version() -> str:
        major, minor = cupy.cuda.nvrtc.getVersion()
        return f"{major}.{minor}"

    return _call_or_reason(version)


def _driver_version(runtime) -> str:
    def version() -> str:
        number = runtime.driverGetVersion()
        # cudaDriverGetVersion reports 0 when no driver is installed, rather than failing.
        return _cuda_version(number) if number else "no CUDA driver installed"

    return _call_or_reason(version)


def _gpu_rows(runtime) -> list[tuple[str, str]]:
    try:
        count = runtime.getDeviceCount()
    except Exception as error:
        return [("gpu", f"no CUDA GPU visible ({_reason(error)})")]
    if count == 0:
        return [("gpu", "no CUDA GPU visible (the driver reports 0 devices)")]
    return [(f"gpu {index}", _describe_device(runtime, index)) for index in range(count)]


def _describe_device(runtime, index: int) -> str:
    def describe() -> str:
        properties = runtime.getDeviceProperties(index)
        name = properties["name"]
        name = name.decode() if isinstance(name, bytes) else str(name)
        capability = f"{properties['major']}.{properties['minor']}"
        memory = _human_size(properties["totalGlobalMem"])
        return f"{name}, compute capability {capability}, {memory}"

    return _call_or_reason(describe)


def _cuda_version(number: int) -> str:
    """CUDA encodes versions as 1000 * major + 10 * minor: 12090 is 12.9."""
    return f"{number // 1000}.{(number % 1000) // 10}"


def _call_or_reason(function: Callable[[], str]) -> str:
    try:
        return function()
    except Exception as error:
        return f"unavailable ({_reason(error)})"


def _reason(error: Exception) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


# -- flame cache ------------------------------------------------------------------------------


def _add_cache(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser("cache", help="inspect or clear the on-disk kernel cache")
    parser.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="cache directory (default: $FLAME_CACHE_DIR, $XDG_CACHE_HOME/flame, ~/.cache/flame)",
    )
    actions = parser.add_subparsers(title="actions", metavar="ACTION", required=True)
    actions.add_parser("list", help="one line per entry: key, size, time").set_defaults(
        run=_run_cache_list
    )
    actions.add_parser("size", help="number of entries and their total size").set_defaults(
        run=_run_cache_size
    )
    actions.add_parser("clear", help="remove every entry").set_defaults(run=_run_cache_clear)


def _open_cache(directory: Path | None):
    # Imported here so `flame --version` never pays for the runtime package.
    from flame.runtime.cache import DiskCache

    return DiskCache(directory)


def _cache_rows(directory: Path | None) -> list[tuple[str, str]]:
    cache = _open_cache(directory)
    entries = cache.entries()
    total = sum(size for _, size, _ in entries)
    return [
        ("cache dir", str(cache.root)),
        ("cache size", f"{_plural(len(entries), 'entry', 'entries')}, {_human_size(total)}"),
    ]


def _run_cache_list(arguments: argparse.Namespace) -> int:
    cache = _open_cache(arguments.dir)
    entries = cache.entries()
    for key, size, mtime in entries:
        when = datetime.datetime.fromtimestamp(mtime).isoformat(sep=" ", timespec="seconds")
        print(f"{key}  {size:>10}  {when}")
    total = sum(size for _, size, _ in entries)
    print(f"{_plural(len(entries), 'entry', 'entries')}, {_human_size(total)} in {cache.root}")
    return 0


def _run_cache_size(arguments: argparse.Namespace) -> int:
    for name, value in _cache_rows(arguments.dir):
        print(f"{name}: {value}")
    return 0


def _run_cache_clear(arguments: argparse.Namespace) -> int:
    cache = _open_cache(arguments.dir)
    removed = cache.clear()
    print(f"removed {_plural(removed, 'entry', 'entries')} from {cache.root}")
    return 0


def _plural(count: int, singular: str, plural: str) -> str:
    return f"{count} {singular if count == 1 else plural}"


def _human_size(size: int) -> str:
    if size < 1024:
        return f"{size} B"
    value = size / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


# -- flame dump / flame check ------------------------------------------------------------------


def _add_dump(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "dump",
        help="run a script and dump every graph: IR per pass, fusion, kernels, cache",
        description="Run SCRIPT with ARGS and write what FLAME did with every graph to DIR: "
        "the IR after each pass, the fusion groups and why each boundary exists, every "
        "kernel's CUDA source, NVRTC resource usage, launch shape, bytes moved against the "
        "floor, cache hits and misses with reasons, and an HTML picture. Options of flame "
        "dump may come before or after SCRIPT; put the script's own options after `--` when "
        "they share a name. Without a GPU the script runs on the reference backend.",
    )
    parser.add_argument("--out", metavar="DIR", help=f"dump folder (default: {_DUMP_FOLDER})")
    parser.add_argument("--profile", action="store_true", help="time every kernel on the GPU")
    parser.add_argument(
        "--bandwidth",
        metavar="GBPS",
        help="copy bandwidth for the floor, GB/s (default: $FLAME_BANDWIDTH or 2970, the H100's)",
    )
    parser.add_argument("script", help="the Python script to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    parser.set_defaults(run=_run_dump)


_DUMP_FOLDER = "flame_dump"


def _tool_options(arguments: argparse.Namespace, flags: dict[str, bool]) -> dict:
    """Pull the tool's own options out of the script's arguments (up to a `--`)."""
    found: dict = {name: getattr(arguments, name.lstrip("-")) for name in flags}
    rest = list(arguments.args)
    script_args = []
    while rest:
        item = rest.pop(0)
        if item == "--":
            script_args += rest
            break
        name, _, value = item.partition("=")
        if name in flags and flags[name]:
            found[name] = True
        elif name in flags:
            if not value:
                if not rest:
                    raise SystemExit(f"flame: {name} needs a value")
                value = rest.pop(0)
            found[name] = value
        else:
            script_args.append(item)
    found["args"] = script_args
    return found


def _run_dump(arguments: argparse.Namespace) -> int:
    from flame.tools.dump import bandwidth_from_environment, dump_script, uninstall_environment
    from flame.tools.dumpfiles import DumpError, summary_text
    from flame.tools.script import ScriptNotFound, check_script

    options = _tool_options(arguments, {"--out": False, "--profile": True, "--bandwidth": False})
    uninstall_environment()  # FLAME_DUMP set as well: this command's own recorder wins
    out = Path(options["--out"] or _DUMP_FOLDER)
    try:
        script = check_script(arguments.script)
        bandwidth = bandwidth_from_environment()
        if options["--bandwidth"] is not None:
            bandwidth = float(options["--bandwidth"]) * 1e9
        profile = options["--profile"]
        status, recorder = dump_script(script, options["args"], out, profile, bandwidth)
    except (ScriptNotFound, DumpError) as error:
        print(f"flame dump: {error}", file=sys.stderr)
        return 2
    except ValueError:
        print("flame dump: --bandwidth must be a number of GB/s", file=sys.stderr)
        return 2
    print(summary_text(recorder, status, out, detail=False), end="")
    return 0 if status["complete"] else status.get("exit_code", 1) or 1


def _add_check(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "check",
        help="run a script; compare every fused kernel with the float64 reference",
        description="Run SCRIPT with ARGS on the GPU. On the first run of every plan, each fused "
        "kernel's outputs are compared with the float64 reference interpreter fed the same "
        "inputs; the first kernel outside its tolerance is reported and a standalone repro "
        "(inputs.npz, kernel.cu, launch.json, expected.npz, repro.py) is written to DIR.",
    )
    parser.add_argument("--out", metavar="DIR", help=f"repro folder (default: {_CHECK_FOLDER})")
    parser.add_argument("script", help="the Python script to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    parser.set_defaults(run=_run_check)


_CHECK_FOLDER = "flame_check"


def _run_check(arguments: argparse.Namespace) -> int:
    from flame.runtime.device import gpu_available, gpu_unavailable_reason
    from flame.tools.check import check_script, report_text
    from flame.tools.dump import uninstall_environment
    from flame.tools.script import ScriptNotFound
    from flame.tools.script import check_script as find_script

    options = _tool_options(arguments, {"--out": False})
    try:
        script = find_script(arguments.script)
    except ScriptNotFound as error:
        print(f"flame check: {error}", file=sys.stderr)
        return 2
    if not gpu_available():
        print(
            f"flame check: no GPU ({gpu_unavailable_reason()}). It runs every kernel on the GPU "
            "and compares it with the reference; without one, `flame dump` still renders and "
            "compiles every kernel.",
            file=sys.stderr,
        )
        return 2
    uninstall_environment()
    out = Path(options["--out"] or _CHECK_FOLDER)
    status, recorder = check_script(script, options["args"], out)
    print(
        f"flame check: {recorder.kernels_checked} kernels of {recorder.plans_checked} plans "
        "compared with the float64 reference"
    )
    for problem in recorder.problems:
        print(f"  {problem}")
    if recorder.failure is not None:
        print(report_text(recorder.failure))
        return 1
    if not status["complete"]:
        print(f"flame check: stopped early: {status.get('reason')}", file=sys.stderr)
        return status.get("exit_code", 1) or 1
    print("every kernel is within its tolerance")
    return 0


# -- flame run --------------------------------------------------------------------------------


def _add_run(subcommands: argparse._SubParsersAction) -> None:
    # The launcher's options live with it (flame/distributed/launch.py, stdlib only), so that
    # `python -m flame.distributed.launch` takes the same ones.
    from flame.distributed import launch

    parser = subcommands.add_parser(
        "run",
        help="start N processes of a script for data-parallel training (as torchrun)",
        description=launch.DESCRIPTION,
    )
    launch.add_arguments(parser)
    parser.set_defaults(run=_run_run)


def _run_run(arguments: argparse.Namespace) -> int:
    from flame.distributed import launch

    return launch.run(arguments)


_SUBCOMMANDS = [_add_info, _add_cache, _add_dump, _add_check, _add_run]


if __name__ == "__main__":
    raise SystemExit(main())
