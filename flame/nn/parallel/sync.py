"""What ``DistributedDataParallel`` does across ranks besides averaging gradients: checking
that every rank built the same model, and copying rank 0's parameters and buffers to the
others (at wrap time, and the buffers again before each forward).

Both use the public collectives of ``flame.distributed`` on the default group.
"""

from __future__ import annotations

import json

import numpy as np

import flame.distributed as dist
from flame.autograd import no_grad
from flame.backend import backend
from flame.compile import current_trace
from flame.creation import tensor
from flame.joining import cat
from flame.tensor import Tensor

# PyTorch broadcasts module states in coalesced buckets of 250 MiB
BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024


def describe(dtype, shape) -> str:
    return f"{dtype.name}{list(shape)}"


def model_entries(named_params, named_buffers) -> list[list]:
    """One ``[kind, name, type, requires_grad]`` per parameter and buffer, in module order."""
    entries = [
        ["parameter", name, describe(p.dtype, p.shape), bool(p.requires_grad)]
        for name, p in named_params
    ]
    entries += [["buffer", name, describe(b.dtype, b.shape), False] for name, b in named_buffers]
    return entries


def verify_same_model(entries: list[list], options: dict, backend_name: str) -> None:
    """Every rank sends its model's description to every rank; each compares every rank's
    with rank 0's, so on a difference every rank raises the same error (none goes on to a
    collective the others never reach)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mine = {"world_size": world_size, "options": options, "entries": entries}
    everyone = _all_gather_json(mine, world_size, backend_name)
    for other in range(1, world_size):
        difference = _first_difference(everyone[0], everyone[other], other)
        if difference is not None:
            where = f" (this process is rank {rank})"
            raise RuntimeError(
                f"DistributedDataParallel: the model differs across ranks: {difference}"
                f"{where}. Every rank must build the same model (same parameters and buffers, "
                "in the same order, with the same shapes and dtypes) and pass the same "
                "DistributedDataParallel arguments."
            )


def _all_gather_json(value, world_size: int, backend_name: str) -> list:
    """``value`` (JSON-able) from every rank, in rank order (on the model's backend: a
    backend's collectives may take only its own tensors)."""

    def make(array: np.ndarray) -> Tensor:
        with backend(backend_name):
            return tensor(array)

    data = np.frombuffer(json.dumps(value).encode(), np.uint8)
    lengths = [make(np.zeros(1, np.int64)) for _ in range(world_size)]
    dist.all_gather(lengths, make(np.array([data.size], np.int64)))
    longest = max(int(length.numpy()[0]) for length in lengths)
    padded = np.zeros(longest, np.uint8)
    padded[: data.size] = data
    gathered = [make(np.zeros(longest, np.uint8)) for _ in range(world_size)]
    dist.all_gather(gathered, make(padded))
    return [
        json.loads(bytes(item.numpy()[: int(length.numpy()[0])]).decode())
        for item, length in zip(gathered, lengths)
    ]


def _first_difference(root: dict, other: dict, rank: int) -> str | None:
    if other["world_size"] != root["world_size"]:
        return f"rank {rank} has world_size {other['world_size']}, rank 0 has {root['world_size']}"
    for (kind, name, shown, grad), (kind0, name0, shown0, grad0) in zip(
        other["entries"], root["entries"]
    ):
        if (kind, name) != (kind0, name0):
            return f"rank {rank} has {kind} {name!r} where rank 0 has {kind0} {name0!r}"
        if shown != shown0:
            return f"{kind} {name!r} is {shown} on rank {rank} but {shown0} on rank 0"
        if grad != grad0:
            return (
                f"{kind} {name!r} has requires_grad={grad} on rank {rank} but "
                f"requires_grad={grad0} on rank 0"
            )
    count, count0 = len(other["entries"]), len(root["entries"])
    if count > count0:
        kind, name, shown, _ = other["entries"][count0]
        return f"rank {rank} has an extra {kind} {name!r} ({shown}) that rank 0 does not have"
    if count < count0:
        kind, name, shown, _ = root["entries"][count]
        return f"rank {rank} lacks {kind} {name!r} ({shown}) that rank 0 has"
    for key in sorted(set(root["options"]) | set(other["options"])):
        value, value0 = other["options"].get(key), root["options"].get(key)
        if value != value0:
            return f"DistributedDataParallel({key}={value!r}) on rank {rank}, {value0!r} on rank 0"
    return None


def broadcast_tensors(tensors: list[Tensor], src: int = 0) -> None:
    """Rank ``src``'s values written into ``tensors`` on every rank: one broadcast per dtype
    (and per 250 MiB), the tensors flattened into one buffer and copied back in place."""
    if dist.get_world_size() == 1:
        return
    for group in _coalesced(tensors):
        with no_grad():
            flat = cat([t.reshape(-1) for t in group])
            if current_trace() is None:
                flat.realize()  # memory the collective writes into
            dist.broadcast(flat, src)
            if dist.get_rank() == src and current_trace() is None:
                # (traced, the source copies its own values back too: a collective whose
                # result nothing reads would leave the program, and the other ranks waiting)
                continue
            offset = 0
            for t in group:
                t.copy_(flat[offset : offset + t.numel()].reshape(t.shape))
                offset += t.numel()


def _coalesced(tensors: list[Tensor]) -> list[list[Tensor]]:
    groups: dict = {}
    result = []
    for t in tensors:
        if t.numel() == 0:
            continue
        key = (t.dtype, t.backend)
        group = groups.get(key)
        if group is None or group[1] + t.numel() * t.dtype.itemsize > BROADCAST_BUCKET_BYTES:
            group = groups[key] = [[], 0]
            result.append(group[0])
        group[0].append(t)
        group[1] += t.numel() * t.dtype.itemsize
    return result
