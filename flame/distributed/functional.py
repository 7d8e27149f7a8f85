"""Collectives as values: each function returns a new lazy tensor (one IR node, see
flame/ir/ops/collective.py) and changes nothing in place, like
``torch.distributed._functional_collectives``. ``flame.distributed.all_reduce`` and its
siblings are built on these for the ``nccl`` backend.

    total = functional.all_reduce(grad, "avg")        # lazy: runs with whatever reads it

The group is the default process group (it must use the ``nccl`` backend), unless
``world_size`` and ``group_name`` are given: ``world_size=1, group_name=""`` builds the
collective of a world of one, which the reference backend computes (a copy), so graphs with
collectives can be built, printed and checked without a GPU.

A lazy collective runs when its value is needed. Every rank must run the same collectives in
the same order (NCCL matches them by order), so a program that leaves collectives lazy must
realize them in the same order on every rank; ``flame.distributed.all_reduce`` and friends
queue theirs at the call, which keeps the order of the calls. Inside ``flame.compile`` the
order is the program's, the same on every rank that traced the same function.
"""

from __future__ import annotations

from flame.tensor import Tensor, apply_op

REDUCE_OP_NAMES = ("sum", "avg", "product", "max", "min")


def reduce_op_name(op) -> str:
    """``ReduceOp.AVG`` or ``"avg"`` -> ``"avg"``."""
    name = getattr(op, "value", op)
    if name not in REDUCE_OP_NAMES:
        raise ValueError(f"expected a ReduceOp ({', '.join(REDUCE_OP_NAMES)}), got {op!r}")
    return name


def _group(world_size: int | None, group_name: str | None, name: str) -> tuple[int, str]:
    if world_size is not None and group_name is not None:
        return world_size, group_name
    if world_size is not None or group_name is not None:
        raise ValueError(f"{name}: give both world_size and group_name, or neither")
    from flame.distributed import _default
    from flame.distributed.nccl import NcclGroup

    group = _default().group
    if not isinstance(group, NcclGroup):
        raise RuntimeError(
            f"{name}: collectives as lazy values need the nccl backend; the default process "
            f"group uses {type(group).__name__}"
        )
    group.check_alive(name)
    return group.world_size, group.name


def _check_tensor(tensor, name: str) -> None:
    if not isinstance(tensor, Tensor):
        raise TypeError(f"{name}: expected a flame Tensor, got {type(tensor).__name__}")


def all_reduce(tensor: Tensor, op="sum", *, world_size=None, group_name=None) -> Tensor:
    """``tensor`` combined over every rank with ``op`` (sum avg product max min)."""
    _check_tensor(tensor, "all_reduce")
    world, group = _group(world_size, group_name, "all_reduce")
    return apply_op("all_reduce", tensor, op=reduce_op_name(op), world=world, group=group)


def broadcast(tensor: Tensor, src: int, *, world_size=None, group_name=None) -> Tensor:
    """Rank ``src``'s ``tensor``, on every rank."""
    _check_tensor(tensor, "broadcast")
    world, group = _group(world_size, group_name, "broadcast")
    return apply_op("broadcast", tensor, src=src, world=world, group=group)


def all_gather(tensor: Tensor, *, world_size=None, group_name=None) -> Tensor:
    """``[world, *tensor.shape]``: row r is rank r's ``tensor``."""
    _check_tensor(tensor, "all_gather")
    world, group = _group(world_size, group_name, "all_gather")
    return apply_op("all_gather", tensor, world=world, group=group)


def reduce_scatter(tensor: Tensor, op="sum", *, world_size=None, group_name=None) -> Tensor:
    """``tensor`` is ``[world, *rest]``; rank r gets row r combined over every rank."""
    _check_tensor(tensor, "reduce_scatter")
    world, group = _group(world_size, group_name, "reduce_scatter")
    return apply_op("reduce_scatter", tensor, op=reduce_op_name(op), world=world, group=group)
