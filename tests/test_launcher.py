"""`flame run` (flame/distributed/launch.py): ranks, their environment, their output, and what
happens when one fails or the launcher is interrupted.

Every job is the real command (`python -m flame run ...`) in a child process, running a small
script written into the test's folder. The ranks write their PIDs (and those of the sleepers
they start) into that folder, so a test can wait until they run and check afterwards that
none is left. Every wait has a deadline, so a hang fails the test instead of CI.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flame.distributed import launch

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform == "win32", reason="the launcher uses POSIX sessions"),
]

REPO_ROOT = Path(__file__).resolve().parents[1]
DEADLINE_S = 60.0

# The top of every rank script: its rank, its folder, and two helpers.
PRELUDE = """
import json, os, signal, subprocess, sys, time
from pathlib import Path

rank = int(os.environ["RANK"])
marks = Path(os.environ["FLAME_TEST_DIR"])

def mark(name, text=""):
    (marks / (name + ".tmp")).write_text(str(text))
    os.replace(marks / (name + ".tmp"), marks / name)

def wait_for(*names):
    deadline = time.monotonic() + 30
    while not all((marks / name).exists() for name in names):
        assert time.monotonic() < deadline, f"rank {rank}: {names} never appeared"
        time.sleep(0.02)

def start_sleeper():
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    mark(f"pid-sleeper-{rank}", sleeper.pid)

mark(f"pid-{rank}", os.getpid())
"""


# --- the harness ----------------------------------------------------------------------------
def environment(tmp_path: Path, **extra: str) -> dict[str, str]:
    variables = dict(os.environ, FLAME_TEST_DIR=str(tmp_path), **extra)
    existing = variables.get("PYTHONPATH")
    variables["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), existing]))
    return variables


def write_script(tmp_path: Path, body: str, name: str = "job.py") -> Path:
    script = tmp_path / name
    script.write_text(PRELUDE + body)
    return script


def flame_run(tmp_path: Path, *arguments: str, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flame", "run", *arguments],
        cwd=tmp_path,
        env=environment(tmp_path, **extra),
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
    )


def rank_lines(output: str, rank: int) -> list[str]:
    prefix = f"[rank{rank}]: "
    return [line[len(prefix) :] for line in output.splitlines() if line.startswith(prefix)]


def recorded_pids(tmp_path: Path) -> dict[str, int]:
    return {path.name: int(path.read_text()) for path in tmp_path.glob("pid-*")}


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting for a reaper counts as gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (macOS): ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def assert_all_gone(tmp_path: Path, expected: int) -> None:
    pids = recorded_pids(tmp_path)
    assert len(pids) == expected, pids
    deadline = time.monotonic() + 5.0  # SIGKILL is asynchronous: allow the kernel a moment
    while any(alive(pid) for pid in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = {name: pid for name, pid in pids.items() if alive(pid)}
    for pid in left.values():  # do not leave them to the next test either
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes left running: {left}"


# --- environment and output ------------------------------------------------------------------
SHOW_ENVIRONMENT = """
names = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
         "MASTER_PORT", "CUDA_VISIBLE_DEVICES"]
print(json.dumps({"argv": sys.argv[1:], **{name: os.environ.get(name) for name in names}}))
print(f"rank {rank} writes to stderr", file=sys.stderr)
"""


def environments(output: str, ranks: range) -> list[dict]:
    return [json.loads(rank_lines(output, rank)[0]) for rank in ranks]


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("as_module", [False, True], ids=["script", "module"])
def test_every_rank_gets_its_environment_and_arguments(tmp_path, world_size, as_module):
    write_script(tmp_path, SHOW_ENVIRONMENT)
    target = ["-m", "job"] if as_module else ["job.py"]
    options = ["--nproc-per-node", str(world_size), *target, "--lr", "3e-4", "--", "x y"]
    result = flame_run(tmp_path, *options, CUDA_VISIBLE_DEVICES="0,1")
    assert result.returncode == 0, result.stderr
    seen = environments(result.stdout, range(world_size))
    port = seen[0]["MASTER_PORT"]
    assert 0 < int(port) < 65536
    for rank, variables in enumerate(seen):
        assert variables == {
            "argv": ["--lr", "3e-4", "--", "x y"],
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "CUDA_VISIBLE_DEVICES": "0,1",  # left alone: each rank picks its GPU by LOCAL_RANK
        }
        assert rank_lines(result.stderr, rank) == [f"rank {rank} writes to stderr"]
    assert len(result.stdout.splitlines()) == world_size  # nothing unprefixed on stdout


def test_second_node_ranks_and_fixed_port(tmp_path):
    write_script(tmp_path, SHOW_ENVIRONMENT)
    options = ["--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1"]
    options += ["--master-port", "29999", "--nproc-per-node", "2", "job.py"]
    result = flame_run(tmp_path, *options)
    assert result.returncode == 0, result.stderr
    seen = environments(result.stdout, range(2, 4))
    assert [item["RANK"] for item in seen] == ["2", "3"]
    assert [item["LOCAL_RANK"] for item in seen] == ["0", "1"]
    assert {(item["WORLD_SIZE"], item["GROUP_RANK"], item["MASTER_PORT"]) for item in seen} == {
        ("4", "1", "29999")
    }


def test_bind_gpus_gives_each_rank_its_own_device(tmp_path):
    write_script(tmp_path, SHOW_ENVIRONMENT)
    options = ["--nproc-per-node", "2", "--bind-gpus", "job.py"]
    result = flame_run(tmp_path, *options, CUDA_VISIBLE_DEVICES="5,7")
    assert result.returncode == 0, result.stderr
    assert [item["CUDA_VISIBLE_DEVICES"] for item in environments(result.stdout, range(2))] == [
        "5",
        "7",
    ]
    result = flame_run(tmp_path, *options, CUDA_VISIBLE_DEVICES="5")
    assert result.returncode == 2 and "local rank 1 has no GPU" in result.stderr, result.stderr


def test_no_prefix_passes_lines_through(tmp_path):
    write_script(tmp_path, SHOW_ENVIRONMENT)
    result = flame_run(tmp_path, "--nproc-per-node", "2", "--no-prefix", "job.py")
    assert result.returncode == 0, result.stderr
    ranks = sorted(json.loads(line)["RANK"] for line in result.stdout.splitlines())
    assert ranks == ["0", "1"]
    assert sorted(result.stderr.splitlines()) == [f"rank {r} writes to stderr" for r in (0, 1)]


# --- failures --------------------------------------------------------------------------------
RAISES = """
if rank == 1:
    wait_for("pid-0", "pid-2", "pid-sleeper-0", "pid-sleeper-2")
    print("rank 1 about to fail", file=sys.stderr)
    raise ValueError("boom from rank 1")
start_sleeper()
time.sleep(60)
"""


def test_a_rank_that_raises_stops_the_others_and_is_reported(tmp_path):
    write_script(tmp_path, RAISES)
    started = time.monotonic()
    result = flame_run(tmp_path, "--nproc-per-node", "3", "job.py")
    assert time.monotonic() - started < 30  # not the others' 60 s
    assert result.returncode == 1, result.stderr
    report = result.stderr.split("flame run: rank 1 (local rank 1, pid ")[1]
    assert ") failed first: exit code 1\n" in report
    # the tail of its error output, at the end of the report, after its own lines above
    assert "[rank1]: rank 1 about to fail\n[rank1]: Traceback" in report
    assert "[rank1]: ValueError: boom from rank 1\n" in report
    for rank in (0, 2):
        assert f"flame run: rank {rank}: stopped by SIGTERM" in report
    assert_all_gone(tmp_path, expected=5)  # three ranks and the two sleepers they started


def test_a_rank_killed_by_a_signal_is_reported(tmp_path):
    body = """
if rank == 0:
    wait_for("pid-1")
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(60)
"""
    write_script(tmp_path, body)
    result = flame_run(tmp_path, "--nproc-per-node", "2", "job.py")
    assert result.returncode == 128 + signal.SIGKILL, result.stderr
    assert "failed first: killed by SIGKILL (signal 9)" in result.stderr
    assert "rank 0 wrote nothing to stderr" in result.stderr
    assert "flame run: rank 1: stopped by SIGTERM" in result.stderr
    assert_all_gone(tmp_path, expected=2)


def test_a_rank_that_ignores_sigterm_is_killed_after_the_grace_period(tmp_path):
    body = """
if rank == 0:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    mark("ignoring")
    time.sleep(60)
wait_for("ignoring")
sys.exit(3)
"""
    write_script(tmp_path, body)
    started = time.monotonic()
    result = flame_run(tmp_path, "--nproc-per-node", "2", "--grace-period", "1", "job.py")
    elapsed = time.monotonic() - started
    assert result.returncode == 3, result.stderr
    assert 1.0 <= elapsed < 30
    assert "killed rank 0 (SIGKILL) after the 1 s grace period" in result.stderr
    assert "rank 1 (local rank 1" in result.stderr and "failed first: exit code 3" in result.stderr
    assert "rank 0: stopped by SIGKILL after the 1 s grace period" in result.stderr
    assert_all_gone(tmp_path, expected=2)


@pytest.mark.parametrize(
    "sent, status, message",
    [(signal.SIGINT, 130, "KeyboardInterrupt"), (signal.SIGTERM, 143, "SIGTERM handled")],
    ids=["SIGINT", "SIGTERM"],
)
def test_interrupting_the_launcher_stops_every_rank(tmp_path, sent, status, message):
    body = """
def on_sigterm(number, frame):
    print(f"rank {rank}: SIGTERM handled", flush=True)
    sys.exit(0)

signal.signal(signal.SIGTERM, on_sigterm)
start_sleeper()
mark(f"ready-{rank}")
try:
    time.sleep(60)
except KeyboardInterrupt:
    print(f"rank {rank}: KeyboardInterrupt", flush=True)
"""
    write_script(tmp_path, body)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "flame", "run", "--nproc-per-node", "2", "job.py"],
        cwd=tmp_path,
        env=environment(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not all((tmp_path / f"ready-{rank}").exists() for rank in (0, 1)):
            assert launcher.poll() is None, launcher.communicate()
            assert time.monotonic() < deadline, "the ranks never started"
            time.sleep(0.02)
        launcher.send_signal(sent)
        stdout, stderr = launcher.communicate(timeout=30)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == status, stderr
    assert f"interrupted ({sent.name}): stopping every rank" in stderr
    for rank in (0, 1):
        assert rank_lines(stdout, rank) == [f"rank {rank}: {message}"]
    assert_all_gone(tmp_path, expected=4)


GLOO_WORLD = """
import datetime
import numpy as np
import flame as fl
import flame.distributed as dist

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
if rank == 1 and "--fail" in sys.argv:
    raise RuntimeError("rank 1 gave up before all_reduce")
values = fl.tensor(np.arange(4, dtype=np.float32)) * float(rank + 1)
dist.all_reduce(values)
print(json.dumps({"rank": dist.get_rank(), "world": dist.get_world_size(),
                  "sum": values.tolist()}))
dist.destroy_process_group()
"""


def run_gloo_world(tmp_path: Path, *arguments: str) -> subprocess.CompletedProcess:
    """A free port can be taken between the launcher's probe and rank 0's bind: try again."""
    write_script(tmp_path, GLOO_WORLD)
    for _ in range(3):
        options = ["--nproc-per-node", "2", "job.py", *arguments]
        result = flame_run(tmp_path, *options, FLAME_BACKEND="reference")
        if "is the port in use" not in result.stderr:
            break
    return result


def test_a_gloo_world_through_the_launcher(tmp_path):
    result = run_gloo_world(tmp_path)
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        reported = json.loads(rank_lines(result.stdout, rank)[-1])
        assert reported == {"rank": rank, "world": 2, "sum": [0.0, 3.0, 6.0, 9.0]}


def test_a_gloo_rank_that_fails_stops_the_one_waiting_in_all_reduce(tmp_path):
    started = time.monotonic()
    result = run_gloo_world(tmp_path, "--fail")
    assert time.monotonic() - started < 20  # not the group's 20 s timeout
    assert result.returncode == 1, result.stderr
    first = re.search(
        r"flame run: rank (\d) \(local rank \d, pid \d+\)[^\n]*failed first: exit code 1",
        result.stderr,
    )
    assert first, result.stderr
    report = result.stderr[first.start() :]
    if first.group(1) == "1":
        # rank 0 is stopped, or fails on its own seeing rank 1's connection close
        pattern = r"flame run: rank 0: (stopped by SIGTERM|exit code 1 after SIGTERM)"
        assert re.search(pattern, report), report
    # (on a loaded machine rank 0's own failure on the closed connection can be seen first;
    # rank 1's error is shown either way)
    assert "[rank1]: RuntimeError: rank 1 gave up before all_reduce" in result.stderr
    assert_all_gone(tmp_path, expected=2)


NCCL_WORLD = """
import datetime
import numpy as np
import flame as fl
import flame.distributed as dist

dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=60))
if rank == 1 and "--fail" in sys.argv:
    raise RuntimeError("rank 1 gave up before all_reduce")
values = fl.tensor(np.arange(4, dtype=np.float32)) * float(rank + 1)
dist.all_reduce(values)  # with --fail, rank 0 waits here inside NCCL, which never times out
print(json.dumps({"rank": dist.get_rank(), "world": dist.get_world_size(),
                  "sum": values.tolist()}))
dist.destroy_process_group()
"""


@pytest.mark.gpu
def test_an_nccl_world_of_every_gpu_through_the_launcher(tmp_path):
    world = launch.visible_gpu_count()
    write_script(tmp_path, NCCL_WORLD)
    result = flame_run(tmp_path, "--nproc-per-node", "gpu", "job.py", FLAME_BACKEND="cuda")
    assert result.returncode == 0, result.stderr
    total = world * (world + 1) / 2
    for rank in range(world):
        reported = json.loads(rank_lines(result.stdout, rank)[-1])
        assert reported == {"rank": rank, "world": world, "sum": [0.0, total, 2 * total, 3 * total]}


@pytest.mark.gpu
def test_an_nccl_rank_that_fails_stops_the_one_waiting_in_nccl(tmp_path):
    if launch.visible_gpu_count() < 2:
        pytest.skip("needs 2 GPUs: NCCL refuses two ranks on one GPU")
    write_script(tmp_path, NCCL_WORLD)
    started = time.monotonic()
    options = ["--nproc-per-node", "2", "job.py", "--fail"]
    result = flame_run(tmp_path, *options, FLAME_BACKEND="cuda")
    assert time.monotonic() - started < 50  # not the group's 60 s timeout
    assert result.returncode == 1, result.stderr
    report = result.stderr.split("flame run: rank 1 (local rank 1, pid ")[1]
    assert "[rank1]: RuntimeError: rank 1 gave up before all_reduce" in report
    assert_all_gone(tmp_path, expected=2)


# --- bad input and help ----------------------------------------------------------------------
def test_missing_script_is_a_clear_error(tmp_path):
    result = flame_run(tmp_path, "--nproc-per-node", "2", "no_such_script.py")
    assert result.returncode == 2
    assert result.stderr == "flame run: no such script: no_such_script.py\n"
    assert result.stdout == ""


@pytest.mark.parametrize(
    "options, message",
    [
        (["--nproc-per-node", "0"], "--nproc-per-node must be at least 1, got 0"),
        (["--nproc-per-node", "two"], "--nproc-per-node must be a number or `gpu`, got 'two'"),
        (["--nnodes", "2", "--node-rank", "2", "--master-addr", "h"], "--node-rank 2 is outside"),
        (["--nnodes", "2"], "--nnodes 2 needs --master-addr"),
        (["--master-port", "70000"], "--master-port 70000 is not a port number"),
        (["--grace-period", "-1"], "--grace-period must not be negative"),
    ],
    ids=["zero", "word", "node-rank", "master-addr", "port", "grace"],
)
def test_bad_options_are_named(tmp_path, capsys, options, message):
    script = write_script(tmp_path, "")
    assert launch.main([*options, str(script)]) == 2
    assert message in capsys.readouterr().err
    assert recorded_pids(tmp_path) == {}  # nothing started


def test_a_directory_is_not_a_script(tmp_path, capsys):
    assert launch.main([str(tmp_path)]) == 2
    assert f"not a file: {tmp_path}" in capsys.readouterr().err


def test_nproc_gpu_without_a_gpu_is_an_error(tmp_path):
    write_script(tmp_path, SHOW_ENVIRONMENT)
    result = flame_run(tmp_path, "--nproc-per-node", "gpu", "job.py", CUDA_VISIBLE_DEVICES="")
    assert result.returncode == 2
    assert "--nproc-per-node gpu: no GPU is visible" in result.stderr
    assert recorded_pids(tmp_path) == {}


@pytest.mark.parametrize(
    "cuda, smi, visible, expected",
    [
        (2, 8, None, 2),  # CUDA's count wins (it already honours CUDA_VISIBLE_DEVICES)
        (0, 8, None, 0),
        (None, 4, None, 4),  # no CuPy: nvidia-smi -L
        (None, 4, "1,0", 2),
        (None, 4, "GPU-1234,MIG-5", 2),
        (None, 4, "0,-1,1", 1),  # CUDA stops at the first entry that is not a device
        (None, 4, "", 0),
        (None, None, None, 0),  # neither: no GPU
    ],
)
def test_gpu_count_rule(monkeypatch, cuda, smi, visible, expected):
    monkeypatch.setattr(launch, "_cuda_device_count", lambda: cuda)
    monkeypatch.setattr(launch, "_nvidia_smi_count", lambda: smi)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert launch.visible_gpu_count() == expected
    if expected:
        assert launch._nproc_per_node("gpu") == expected
    else:
        with pytest.raises(launch.LaunchError, match="no GPU is visible"):
            launch._nproc_per_node("gpu")


def test_help(tmp_path):
    result = flame_run(tmp_path, "--help")
    assert result.returncode == 0, result.stderr
    for option in ("--nproc-per-node", "--nnodes", "--node-rank", "--master-addr", "--master-port"):
        assert option in result.stdout
    assert "usage: flame run" in result.stdout and "LOCAL_RANK" in result.stdout
    module = subprocess.run(
        [sys.executable, "-m", "flame.distributed.launch", "--help"],
        env=environment(tmp_path),
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
    )
    assert module.returncode == 0 and "--nproc-per-node" in module.stdout, module.stderr
    top = subprocess.run(
        [sys.executable, "-m", "flame", "--help"],
        env=environment(tmp_path),
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
    )
    assert "run" in top.stdout.split("commands:")[1]
