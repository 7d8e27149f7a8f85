"""``flame run``'s supervision (flame/distributed/launch.py has its options, the ranks'
environments and its entry points): start the ranks, copy their output, stop the job.

Supervision: every rank runs in its own session (process group), its stdout and stderr lines
are copied to the launcher's with a ``[rankN]: `` prefix, and the launcher waits. The first
rank to exit non-zero or die of a signal stops the job: every rank's group gets SIGTERM, the
ranks still alive after the grace period get SIGKILL, and the launcher reports the failed rank,
its exit code or signal and the last lines of its error output, then exits with that rank's
code (128 + N for signal N). SIGINT, SIGTERM or SIGHUP to the launcher are passed on to every
rank (SIGINT as SIGINT, so Python scripts see KeyboardInterrupt; the others as SIGTERM), with
SIGKILL after the grace period or at a second signal. A launcher killed by SIGKILL cannot stop
its ranks (as with torchrun). POSIX only; the standard library only.
"""

from __future__ import annotations

import collections
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flame.distributed.launch import LaunchConfig

TAIL_LINES = 20  # lines of the failed rank's stderr in the report


@dataclass
class _Rank:
    rank: int
    local_rank: int
    process: subprocess.Popen
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    readers: list[threading.Thread] = field(default_factory=list)
    stopped_by: tuple[signal.Signals, str] | None = None  # the launcher's signal, and when

    def signal_group(self, number: int) -> None:
        """Signal the rank and everything it started (its session's process group)."""
        try:
            os.killpg(self.process.pid, number)
        except (ProcessLookupError, PermissionError):
            pass  # gone already


class _Output:
    """Copies the ranks' output lines to the launcher's streams, whole lines at a time."""

    def __init__(self, prefix: bool):
        self.prefix = prefix
        self.lock = threading.Lock()

    def write(self, stream, line: bytes) -> None:
        target = getattr(stream, "buffer", None)
        with self.lock:
            try:
                if target is None:
                    stream.write(line.decode(errors="replace"))
                else:
                    target.write(line)
                stream.flush()
            except (BrokenPipeError, ValueError):
                pass  # the launcher's own output was closed: keep supervising

    def copy(self, pipe, stream, rank: _Rank, is_error: bool) -> None:
        label = f"[rank{rank.rank}]: ".encode() if self.prefix else b""
        for line in iter(pipe.readline, b""):
            if not line.endswith(b"\n"):
                line += b"\n"
            if is_error:
                rank.tail.append(line.decode(errors="replace").rstrip("\n"))
            self.write(stream, label + line)
        pipe.close()


def say(message: str) -> None:
    print(f"flame run: {message}", file=sys.stderr, flush=True)


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name} (signal {-code})"
    return f"exit code {code}"


class _Job:
    def __init__(self, config: LaunchConfig, environments: list[dict]):
        self.config = config
        self.environments = environments  # one per local rank
        self.output = _Output(config.prefix)
        self.ranks: list[_Rank] = []
        self.exits: queue.Queue = queue.Queue()  # ranks, in the order their processes end
        self.signals: list[int] = []  # signals the launcher received, from its handlers
        self.failed: _Rank | None = None
        self.stop_signal: int | None = None
        self.deadline: float | None = None
        self.killed = False
        self.interrupted_by: int | None = None

    def start(self) -> None:
        for local_rank, environment in enumerate(self.environments):
            process = subprocess.Popen(
                self.config.command,
                env=environment,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,  # its own group: stopped with all it started
            )
            rank = _Rank(int(environment["RANK"]), local_rank, process)
            self.ranks.append(rank)
            for pipe, stream, is_error in (
                (process.stdout, sys.stdout, False),
                (process.stderr, sys.stderr, True),
            ):
                reader = threading.Thread(
                    target=self.output.copy, args=(pipe, stream, rank, is_error), daemon=True
                )
                reader.start()
                rank.readers.append(reader)
            waiter = threading.Thread(target=self._wait, args=(rank,), daemon=True)
            waiter.start()

    def _wait(self, rank: _Rank) -> None:
        rank.process.wait()
        self.exits.put(rank)

    def supervise(self) -> int:
        running = len(self.ranks)
        while running:
            self._handle_signals()
            if self.deadline is not None and not self.killed and time.monotonic() > self.deadline:
                self._kill_survivors(f"after the {self.config.grace_period:g} s grace period")
            try:
                rank = self.exits.get(timeout=0.05)
            except queue.Empty:
                continue
            running -= 1
            if rank.process.returncode != 0 and self.stop_signal is None:
                self.failed = rank
                say(
                    f"rank {rank.rank} failed ({describe_exit(rank.process.returncode)}); "
                    f"stopping the other ranks (SIGTERM, then SIGKILL after "
                    f"{self.config.grace_period:g} s)"
                )
                self.stop(signal.SIGTERM)
        if self.stop_signal is not None:
            for rank in self.ranks:  # what the ranks started and left behind
                rank.signal_group(signal.SIGKILL)
        deadline = time.monotonic() + 2.0  # a process the rank left may hold its pipes open
        for rank in self.ranks:
            for reader in rank.readers:
                reader.join(timeout=max(deadline - time.monotonic(), 0.0))
        return self._report()

    def _handle_signals(self) -> None:
        while self.signals:
            number = self.signals.pop(0)
            if self.stop_signal is None:
                forwarded = signal.SIGINT if number == signal.SIGINT else signal.SIGTERM
                say(
                    f"interrupted ({signal.Signals(number).name}): stopping every rank "
                    f"({forwarded.name}, then SIGKILL after {self.config.grace_period:g} s)"
                )
                self.interrupted_by = number
                self.stop(forwarded)
            elif not self.killed:
                self._kill_survivors("at a second signal")

    def stop(self, number: int) -> None:
        self.stop_signal = number
        self.deadline = time.monotonic() + self.config.grace_period
        for rank in self.ranks:
            if rank.process.returncode is None:
                rank.stopped_by = (signal.Signals(number), "")
            rank.signal_group(number)

    def _kill_survivors(self, when: str) -> None:
        self.killed = True
        survivors = [rank for rank in self.ranks if rank.process.returncode is None]
        for rank in survivors:
            rank.stopped_by = (signal.SIGKILL, f" {when}")
            rank.signal_group(signal.SIGKILL)
        if survivors:
            names = ", ".join(str(rank.rank) for rank in survivors)
            say(f"killed rank {names} (SIGKILL) {when}")

    def _report(self) -> int:
        if self.failed is not None:
            failed = self.failed
            code = failed.process.returncode
            where = f"local rank {failed.local_rank}, pid {failed.process.pid}"
            say(f"rank {failed.rank} ({where}) failed first: {describe_exit(code)}")
            if failed.tail:
                say(f"the last lines of rank {failed.rank}'s error output:")
                text = "".join(f"[rank{failed.rank}]: {line}\n" for line in failed.tail)
                print(text, end="", file=sys.stderr, flush=True)
            else:
                say(f"rank {failed.rank} wrote nothing to stderr")
            self._report_others(failed)
            return 128 - code if code < 0 else code  # as a shell reports a signal
        if self.stop_signal is not None:
            self._report_others(None)
            return 128 + self.interrupted_by if self.interrupted_by else 1
        return 0

    def _report_others(self, failed: _Rank | None) -> None:
        for rank in self.ranks:
            if rank is failed:
                continue
            code = rank.process.returncode
            outcome = describe_exit(code)
            if rank.stopped_by is not None:
                number, when = rank.stopped_by
                sent = f"{number.name}{when}"
                outcome = f"stopped by {sent}" if code == -number else f"{outcome} after {sent}"
            say(f"rank {rank.rank}: {outcome}")


_HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def supervise(config: LaunchConfig, environments: list[dict]) -> int:
    """Run the job, local rank ``i`` with ``environments[i]``, to its end; returns the
    launcher's exit status (0 when every rank exits 0)."""
    job = _Job(config, environments)
    saved = {}
    if threading.current_thread() is threading.main_thread():
        # Installed before the ranks start, so they begin with the default handlers (a
        # launcher started with SIGINT ignored, as `cmd &` does, still stops them).
        for number in _HANDLED_SIGNALS:
            saved[number] = signal.signal(number, lambda number, _: job.signals.append(number))
    try:
        try:
            job.start()
        except OSError as error:  # the interpreter vanished, out of processes: stop the rest
            say(f"cannot start local rank {len(job.ranks)}: {error}")
            job.stop(signal.SIGTERM)
        return job.supervise()
    finally:
        for number, handler in saved.items():
            signal.signal(number, handler)
