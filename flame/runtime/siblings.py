"""Other size classes of the row kernels a plan uses, compiled in the background.

A row kernel's code depends on its row-cache class (flame/codegen/reduce.py): a model trained
at several resolutions or aspect-ratio buckets meets each class's first size with an NVRTC
compile on its critical path (30-250 ms measured). After a plan's kernels are loaded, one
daemon thread lowers and compiles the other classes of each new row kernel into the kernel
cache (memory and disk), so a later size of another class finds its kernel there. Work the
thread has not reached costs nothing but its compile; a process that exits stops the thread
(compiles in flight finish). ``FLAME_SIBLING_CLASSES=0`` turns it off.

The thread's lowering is Python and holds the GIL (0.16 s a row kernel, 16 s for the UNet's
step on the H100 host): it waits until no plan has started for ``QUIET_SECONDS``, so that a
first step's end (launch lists, cuDNN plans, the first replay) and the plans that follow it
do not share the interpreter with it.
"""

from __future__ import annotations

import atexit
import functools
import os
import queue
import threading
import time
import weakref

QUIET_SECONDS = 2.0  # background work starts this long after the last plan began
_MAX_KERNELS = 512  # per process: a bound on background work, never on correctness
_running: weakref.WeakSet = weakref.WeakSet()  # compilers to stop at exit


@atexit.register
def _stop_all() -> None:
    for compiler in list(_running):
        compiler.stop()


class SiblingCompiler:
    def __init__(self, kernels, quiet: float = QUIET_SECONDS):
        self.kernels = kernels
        self.quiet = quiet
        self._busy_at = time.monotonic()
        self._queue: queue.Queue = queue.Queue()
        self._seen: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def busy(self) -> None:
        """The foreground started a plan: background work waits for quiet again."""
        self._busy_at = time.monotonic()

    def submit(self, groups_and_lowered) -> None:
        """Queue the row kernels of a new plan: (group, lowered) pairs."""
        if os.environ.get("FLAME_SIBLING_CLASSES", "1") == "0":
            return
        self.busy()
        fresh = []
        with self._lock:
            if self._stop.is_set():
                return
            for group, lowered in groups_and_lowered:
                if lowered.spec.name not in self._seen and len(self._seen) < _MAX_KERNELS:
                    self._seen.add(lowered.spec.name)
                    fresh.append((group, lowered))
            if fresh and self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="flame-size-classes", daemon=True
                )
                self._thread.start()
                _running.add(self)
            for item in fresh:
                self._queue.put(item)

    def drain(self) -> None:
        """Wait until the queued kernels are compiled (at once after ``stop``)."""
        self._queue.join()

    def stop(self) -> None:
        """Stop after the compile in flight; queued work is dropped."""
        with self._lock:
            self._stop.set()
            self._drop_queued()
            self._queue.put(None)
        if self._thread is not None:
            self._thread.join(5.0)
            if not self._thread.is_alive():  # it may have ended before reaching the None
                self._drop_queued()

    def _drop_queued(self) -> None:
        while True:  # what the thread will not reach counts as done
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return
            self._queue.task_done()

    def _wait_for_quiet(self) -> None:
        while not self._stop.is_set():
            remaining = self._busy_at + self.quiet - time.monotonic()
            if remaining <= 0:
                return
            self._stop.wait(remaining)

    def _run(self) -> None:
        from flame.codegen.reduce import sibling_specs
        from flame.codegen.render import render, spec_key
        from flame.runtime.executor import _layout_of

        while True:
            item = self._queue.get()
            try:
                self._wait_for_quiet()
                if item is None or self._stop.is_set():
                    return
                group, lowered = item
                for spec in sibling_specs(group, _layout_of, lowered):
                    self._wait_for_quiet()
                    if self._stop.is_set():
                        return
                    self.kernels.cubin(
                        functools.partial(render, spec), spec.name, spec_key(spec),
                        background=True,
                    )  # fmt: skip
            except Exception:  # noqa: BLE001, S112  best effort: a plan compiles what it needs
                continue
            finally:
                self._queue.task_done()
