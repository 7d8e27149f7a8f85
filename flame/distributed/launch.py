"""``flame run``: start the processes of a data-parallel job, as ``torchrun`` does.

    flame run --nproc-per-node 2 train.py --lr 3e-4
    flame run --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --nproc-per-node gpu train.py
    python -m flame.distributed.launch --nproc-per-node 2 train.py      # the same launcher

Each rank is ``python -u SCRIPT ARGS`` (or ``python -u -m MODULE ARGS``) with RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK (the node rank), MASTER_ADDR and MASTER_PORT in its
environment, which is all ``flame.distributed.init_process_group`` reads. The launcher does not
choose GPUs: every rank sees the same devices and picks its own from LOCAL_RANK (as PyTorch
scripts do with ``torch.cuda.set_device(local_rank)``); ``--bind-gpus`` instead narrows each
rank's CUDA_VISIBLE_DEVICES to its one GPU. With N > 1 and OMP_NUM_THREADS unset, the ranks get
OMP_NUM_THREADS=1, as from torchrun. Output is copied line by line: a progress bar redrawn
with '\\r' shows at its next newline.

Supervision (flame/distributed/supervision.py): every rank runs in its own session, its output
lines are copied with a ``[rankN]: `` prefix, and the first rank to fail stops the job (SIGTERM,
then SIGKILL after the grace period). POSIX only; the standard library only (CuPy, if there,
to count GPUs).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass

from flame.distributed.supervision import TAIL_LINES as TAIL_LINES  # re-exported
from flame.distributed.supervision import say as _say
from flame.distributed.supervision import supervise

DEFAULT_MULTI_NODE_PORT = 29500  # torchrun's default when several nodes must agree on one
DEFAULT_GRACE_PERIOD_S = 5.0

DESCRIPTION = (
    "Start N processes of `python SCRIPT ARGS` (torchrun's way) with RANK, WORLD_SIZE, "
    "LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR and MASTER_PORT set, for "
    "flame.distributed.init_process_group; their output lines are prefixed with [rankN]:. When "
    "one rank fails, the others get SIGTERM (SIGKILL after the grace period) and the failed "
    "rank, its exit code and its last error lines are reported. Each rank picks its GPU by "
    "LOCAL_RANK: CUDA_VISIBLE_DEVICES is left alone unless --bind-gpus. Launcher options go "
    "before SCRIPT; all after it is the script's."
)


class LaunchError(Exception):
    """Bad options or a job that cannot start; reported as ``flame run: <message>``, exit 2."""


@dataclass
class LaunchConfig:
    command: list[str]  # each rank's argv: python -u SCRIPT ARGS
    nproc_per_node: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    grace_period: float = DEFAULT_GRACE_PERIOD_S
    prefix: bool = True
    bind_gpus: bool = False

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


# --- options ----------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `flame run` and of `python -m flame.distributed.launch`."""
    parser.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        default="1",
        metavar="N",
        help="processes on this node: a number, or `gpu` for one per visible GPU (the count "
        "CUDA reports through CuPy, which honours CUDA_VISIBLE_DEVICES; without CuPy, the "
        "lines of `nvidia-smi -L`, at most as many as CUDA_VISIBLE_DEVICES lists; no GPU is an "
        "error) (default: 1)",
    )
    parser.add_argument("--nnodes", type=int, default=1, help="number of nodes (default: 1)")
    parser.add_argument(
        "--node-rank", "--node_rank", type=int, default=0, help="this node's rank (default: 0)"
    )
    parser.add_argument(
        "--master-addr",
        "--master_addr",
        default=None,
        metavar="ADDR",
        help="address of rank 0's node, where its store listens (default: 127.0.0.1 on one "
        "node; required with --nnodes > 1)",
    )
    parser.add_argument(
        "--master-port",
        "--master_port",
        type=int,
        default=None,
        metavar="PORT",
        help=f"port of rank 0's store (default: a free port on one node, "
        f"{DEFAULT_MULTI_NODE_PORT} with --nnodes > 1)",
    )
    parser.add_argument(
        "--grace-period",
        type=float,
        default=DEFAULT_GRACE_PERIOD_S,
        metavar="SECONDS",
        help="how long stopped ranks get between SIGTERM and SIGKILL "
        f"(default: {DEFAULT_GRACE_PERIOD_S:g})",
    )
    prefix_help = "pass each rank's output lines through without the [rankN]: prefix"
    parser.add_argument("--no-prefix", action="store_true", help=prefix_help)
    parser.add_argument(
        "--bind-gpus",
        action="store_true",
        help="give each rank only its own GPU: CUDA_VISIBLE_DEVICES set to the LOCAL_RANK-th "
        "visible device, so the rank sees it as device 0",
    )
    module_help = "SCRIPT is a module name, run as `python -m SCRIPT`"
    parser.add_argument("-m", "--module", action="store_true", help=module_help)
    parser.add_argument("script", metavar="SCRIPT", help="the Python script each rank runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")


def config_from_arguments(arguments: argparse.Namespace) -> LaunchConfig:
    """Check the options and fill in the defaults; raises ``LaunchError`` naming the option."""
    nnodes, node_rank = arguments.nnodes, arguments.node_rank
    if nnodes < 1:
        raise LaunchError(f"--nnodes must be at least 1, got {nnodes}")
    if not 0 <= node_rank < nnodes:
        raise LaunchError(f"--node-rank {node_rank} is outside 0..{nnodes - 1} (--nnodes {nnodes})")
    if arguments.grace_period < 0:
        raise LaunchError(f"--grace-period must not be negative, got {arguments.grace_period}")
    master_addr = arguments.master_addr
    if master_addr is None and nnodes > 1:
        raise LaunchError(f"--nnodes {nnodes} needs --master-addr, node 0's address for all")
    master_addr = master_addr or "127.0.0.1"
    port = arguments.master_port
    if port is None:
        port = DEFAULT_MULTI_NODE_PORT if arguments.nnodes > 1 else free_port(master_addr)
    if not 0 < port < 65536:
        raise LaunchError(f"--master-port {port} is not a port number (1..65535)")
    return LaunchConfig(
        command=_command(arguments.script, arguments.args, arguments.module),
        nproc_per_node=_nproc_per_node(arguments.nproc_per_node),
        nnodes=arguments.nnodes,
        node_rank=arguments.node_rank,
        master_addr=master_addr,
        master_port=port,
        grace_period=arguments.grace_period,
        prefix=not arguments.no_prefix,
        bind_gpus=arguments.bind_gpus,
    )


def _command(script: str, args: list[str], module: bool) -> list[str]:
    if args[:1] == ["--"]:  # `flame run -n 2 script.py -- --args` as with `flame dump`
        args = args[1:]
    if module:
        return [sys.executable, "-u", "-m", script, *args]
    if not os.path.exists(script):
        raise LaunchError(f"no such script: {script}")
    if not os.path.isfile(script):
        raise LaunchError(f"not a file: {script}")
    return [sys.executable, "-u", script, *args]


def _nproc_per_node(value: str) -> int:
    if value == "gpu":
        count = visible_gpu_count()
        if count == 0:
            raise LaunchError(
                "--nproc-per-node gpu: no GPU is visible (CUDA reports none, or "
                "CUDA_VISIBLE_DEVICES is empty); give a number of processes instead"
            )
        return count
    try:
        count = int(value)
    except ValueError:
        raise LaunchError(f"--nproc-per-node must be a number or `gpu`, got {value!r}") from None
    if count < 1:
        raise LaunchError(f"--nproc-per-node must be at least 1, got {count}")
    return count


# --- GPUs and ports ---------------------------------------------------------------------------
def visible_gpu_count() -> int:
    """How many GPUs a rank started from here would see. CUDA's own count (through CuPy;
    cudaGetDeviceCount initialises the driver but creates no context, and honours
    CUDA_VISIBLE_DEVICES) where CuPy works; else ``nvidia-smi -L``'s lines, at most as many as
    CUDA_VISIBLE_DEVICES lists when it is set; else 0."""
    count = _cuda_device_count()
    if count is not None:
        return count
    physical = _nvidia_smi_count()
    if physical is None:
        return 0
    visible = _cuda_visible_entries(os.environ.get("CUDA_VISIBLE_DEVICES"))
    return physical if visible is None else min(physical, len(visible))


def _cuda_device_count() -> int | None:
    try:
        # The one CuPy call outside flame.runtime: the launcher must not load FLAME's runtime.
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no CuPy, no driver, no device: CuPy raises its own runtime errors
        return None


def _nvidia_smi_count() -> int | None:
    program = shutil.which("nvidia-smi")
    if program is None:
        return None
    try:
        listing = subprocess.run(
            [program, "-L"], capture_output=True, text=True, timeout=30, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return sum(1 for line in listing.stdout.splitlines() if line.startswith("GPU "))


def _cuda_visible_entries(value: str | None) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES's devices (None when it is unset). CUDA stops at the first entry
    that is not a device: a negative or malformed index."""
    if value is None:
        return None
    entries = [entry.strip() for entry in value.split(",")]
    for count, entry in enumerate(entries):
        if not (entry.isdigit() or entry.startswith(("GPU-", "MIG-"))):
            return entries[:count]
    return entries


def free_port(host: str) -> int:
    """A port nothing listens on now (the kernel's choice). Another process may take it before
    rank 0 binds it; rank 0 then fails with 'is the port in use' and the job stops."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((host, 0))
            return probe.getsockname()[1]
    except OSError as error:
        raise LaunchError(f"cannot bind a port on --master-addr {host}: {error}") from None


def rank_environment(config: LaunchConfig, local_rank: int, base: dict[str, str]) -> dict:
    """The environment of local rank ``local_rank``: ``base`` plus torchrun's variables."""
    environment = dict(base)
    environment.update(
        RANK=str(config.node_rank * config.nproc_per_node + local_rank),
        WORLD_SIZE=str(config.world_size),
        LOCAL_RANK=str(local_rank),
        LOCAL_WORLD_SIZE=str(config.nproc_per_node),
        GROUP_RANK=str(config.node_rank),
        MASTER_ADDR=config.master_addr,
        MASTER_PORT=str(config.master_port),
    )
    if config.nproc_per_node > 1 and "OMP_NUM_THREADS" not in base:
        environment["OMP_NUM_THREADS"] = "1"  # as torchrun: N ranks of all-core BLAS thrash
    if config.bind_gpus:
        visible = _cuda_visible_entries(base.get("CUDA_VISIBLE_DEVICES"))
        if visible is not None and local_rank >= len(visible):
            raise LaunchError(
                f"--bind-gpus: local rank {local_rank} has no GPU: CUDA_VISIBLE_DEVICES lists "
                f"{len(visible)} ({base.get('CUDA_VISIBLE_DEVICES')!r})"
            )
        environment["CUDA_VISIBLE_DEVICES"] = (
            str(local_rank) if visible is None else visible[local_rank]
        )
    return environment


# --- the job ----------------------------------------------------------------------------------
def launch(config: LaunchConfig) -> int:
    """Run the job to its end; returns the launcher's exit status (0 when every rank exits 0)."""
    base = dict(os.environ)
    environments = [rank_environment(config, local, base) for local in range(config.nproc_per_node)]
    return supervise(config, environments)


def run(arguments: argparse.Namespace) -> int:
    """``flame run``'s work, from its parsed options."""
    try:
        config = config_from_arguments(arguments)
        return launch(config)
    except LaunchError as error:
        _say(str(error))
        return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flame.distributed.launch", description=DESCRIPTION
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
