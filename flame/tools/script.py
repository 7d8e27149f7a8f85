"""Running a user's script as ``python SCRIPT ARGS...`` would, inside this process, so the
tools (`flame dump`, `flame check`) can listen to what FLAME does while it runs."""

from __future__ import annotations

import os
import runpy
import sys
import traceback
from pathlib import Path


class ScriptNotFound(FileNotFoundError):
    pass


def check_script(path: str) -> Path:
    script = Path(path)
    if not script.exists():
        raise ScriptNotFound(f"no such script: {path}")
    if not script.is_file():
        raise ScriptNotFound(f"not a file: {path}")
    return script


def run_script(script: Path, arguments: list[str]) -> dict:
    """Run ``script`` as ``__main__`` with ``sys.argv = [script, *arguments]``. Returns a
    status: ``complete`` (bool), ``exit_code`` and, when it failed, ``reason``. The script's
    own traceback goes to stderr, starting at its own frames."""
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = [str(script), *arguments]
    sys.path.insert(0, str(script.resolve().parent))
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as stop:
        code = stop.code
        if code in (None, 0):
            return {"complete": True, "exit_code": 0}
        number = code if isinstance(code, int) else 1
        if not isinstance(code, int):
            print(code, file=sys.stderr)
        return {
            "complete": False, "exit_code": number,
            "reason": f"the script exited with status {number}",
        }  # fmt: skip
    except KeyboardInterrupt:
        return {"complete": False, "exit_code": 130, "reason": "interrupted"}
    except BaseException as error:  # the script's own failure: show it as Python would
        print_user_traceback(error, script)
        return {
            "complete": False, "exit_code": 1,
            "reason": f"the script raised {type(error).__name__}: {error}",
        }  # fmt: skip
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return {"complete": True, "exit_code": 0}


def print_user_traceback(error: BaseException, script: Path) -> None:
    """The traceback from the script's first frame on (the tool's frames say nothing)."""
    frames = error.__traceback__
    target = os.path.realpath(script)
    walk = frames
    while walk is not None and os.path.realpath(walk.tb_frame.f_code.co_filename) != target:
        walk = walk.tb_next
    shown = walk if walk is not None else frames
    print("Traceback (most recent call last):", file=sys.stderr)
    print("".join(traceback.format_tb(shown)), end="", file=sys.stderr)
    print("".join(traceback.format_exception_only(type(error), error)), end="", file=sys.stderr)
