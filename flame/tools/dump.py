"""The dump tool's three doors: `flame dump SCRIPT`, ``FLAME_DUMP=DIR python prog.py`` and,
in Python, ``flame.dump(fn, *args)``. Each runs code under a ``DumpRecorder`` and writes (or
prints) what FLAME did with every graph it realized.

Without a GPU the script runs on the reference backend; every kernel is still lowered,
rendered and compiled with NVRTC (for ``FLAME_ARCH``, default sm_90), so the generated code
can be read and checked anywhere.
"""

from __future__ import annotations

import atexit
import os
import sys
import warnings
from pathlib import Path

from flame.runtime import events
from flame.tools.dumpfiles import DumpError, prepare_folder, summary_text, write_dump
from flame.tools.recorder import H100_COPY_BANDWIDTH, DumpRecorder

DEFAULT_OUT = "flame_dump"


def bandwidth_from_environment() -> float:
    """``FLAME_BANDWIDTH`` in GB/s (the floor's copy bandwidth), default the H100's."""
    value = os.environ.get("FLAME_BANDWIDTH")
    if not value:
        return H100_COPY_BANDWIDTH
    try:
        return float(value) * 1e9
    except ValueError:
        raise DumpError(f"FLAME_BANDWIDTH must be a number of GB/s, got {value!r}") from None


def dump_script(script: Path, arguments: list[str], out: Path, profile: bool, bandwidth: float):
    """Run ``script`` under a recorder; write the dump (also when the script fails). Returns
    (status, recorder)."""
    from flame.backend import backend
    from flame.runtime.device import gpu_available, gpu_unavailable_reason
    from flame.tools.script import run_script

    out = prepare_folder(out)
    recorder = DumpRecorder(profile=profile, bandwidth=bandwidth)
    on_gpu = gpu_available()
    if not on_gpu:
        recorder.notes.append(
            f"no GPU ({gpu_unavailable_reason()}): the script ran on the reference backend; "
            "kernels were rendered and compiled with NVRTC but not run"
        )
        if profile:
            recorder.notes.append("--profile needs a GPU: no kernel times were measured")
    with warnings.catch_warnings(record=True) as caught, events.recording(recorder):
        warnings.simplefilter("default")
        if on_gpu:
            status = run_script(script, arguments)
        else:
            with backend("reference"):
                status = run_script(script, arguments)
    _report_warnings(caught, recorder)
    write_dump(out, recorder, status)
    return status, recorder


def _report_warnings(caught, recorder: DumpRecorder) -> None:
    """Cache write failures go into the dump; every other warning is shown as usual."""
    from flame.runtime.cache import CacheWarning

    for item in caught:
        if issubclass(item.category, CacheWarning):
            recorder.notes.append(f"disk cache: {item.message} (kernels compile again next run)")
        else:
            warnings.showwarning(item.message, item.category, item.filename, item.lineno)


def dump(fn, *args, out: str | Path | None = None, profile: bool = False, file=None, **kwargs):
    """Run ``fn(*args, **kwargs)``, realize the tensors it returns, and print the processed IR
    and kernels of every graph realized meanwhile (to ``file``, default stdout). With ``out``
    write the full dump folder too. Returns ``fn``'s result."""
    from flame.tensor import Tensor, realize

    folder = prepare_folder(Path(out)) if out is not None else None
    recorder = DumpRecorder(profile=profile, bandwidth=bandwidth_from_environment())
    with events.recording(recorder):
        result = fn(*args, **kwargs)
        items = result if isinstance(result, (tuple, list)) else (result,)
        tensors = [item for item in items if isinstance(item, Tensor)]
        if tensors:
            realize(*tensors)
    print(describe(recorder), file=file or sys.stdout)
    if folder is not None:
        write_dump(folder, recorder, {"complete": True})
    return result


def describe(recorder: DumpRecorder) -> str:
    """Each graph's processed IR (kernel of each node in its comment) and its kernels."""
    parts = []
    for record in recorder.graphs:
        lines = [f"# {record.title} ({record.backend}): {record.plan_reason}", record.final]
        for kernel in record.kernels:
            lines.append(f"# k{kernel.index} {kernel.kind} over {kernel.label}: {kernel.name}")
            lines += [f"#   {reason}" for reason in kernel.reasons]
        lines += [f"# {line}" for line in record.remat]
        parts.append("\n".join(lines))
    if not parts:
        return "# no graph was realized"
    return "\n\n".join(parts)


# -- FLAME_DUMP=DIR -------------------------------------------------------------------------

_environment_recorder: list = []  # the process's FLAME_DUMP recorder, when there is one


def install_from_environment() -> None:
    """Called by ``import flame`` when ``FLAME_DUMP`` is set: record this context (the main
    thread) until exit, then write the dump there. ``FLAME_DUMP_PROFILE=1`` times kernels."""
    folder = os.environ.get("FLAME_DUMP")
    if not folder or _environment_recorder:
        return
    try:
        out = prepare_folder(Path(folder))
        bandwidth = bandwidth_from_environment()
    except DumpError as error:
        print(f"FLAME_DUMP: {error}; not dumping", file=sys.stderr)
        return
    profile = os.environ.get("FLAME_DUMP_PROFILE", "") not in ("", "0")
    recorder = DumpRecorder(profile=profile, bandwidth=bandwidth)
    context = events.recording(recorder)
    context.__enter__()
    _environment_recorder.append((recorder, out, context))
    _reference_without_gpu(recorder)
    atexit.register(_write_environment_dump)


def _reference_without_gpu(recorder: DumpRecorder) -> None:
    """No GPU and no backend chosen: run on the reference backend, as `flame dump` does."""
    from flame.backend import backend
    from flame.runtime.device import gpu_available, gpu_unavailable_reason

    if os.environ.get("FLAME_BACKEND") or gpu_available():
        return
    choice = backend("reference")
    choice.__enter__()  # for the rest of this context (the main thread), like FLAME_BACKEND
    _environment_recorder.append((recorder, None, choice))
    recorder.notes.append(
        f"no GPU ({gpu_unavailable_reason()}): the program ran on the reference backend; "
        "kernels were rendered and compiled with NVRTC but not run"
    )


def uninstall_environment() -> None:
    """Stop FLAME_DUMP's recorder without writing (`flame dump` records on its own)."""
    while _environment_recorder:
        recorder, _, context = _environment_recorder.pop()
        context.__exit__(None, None, None)


def _write_environment_dump() -> None:
    if not _environment_recorder:
        return
    recorder, out, _ = _environment_recorder[0]
    crashed = getattr(sys, "last_value", None)  # set when the program died of an exception
    status = {"complete": True}
    if crashed is not None:
        status = {"complete": False, "reason": f"the program raised {type(crashed).__name__}"}
    try:
        write_dump(out, recorder, status)
    except DumpError as error:
        print(f"FLAME_DUMP: {error}", file=sys.stderr)
        return
    print(summary_text(recorder, status, out, detail=False), end="", file=sys.stderr)
