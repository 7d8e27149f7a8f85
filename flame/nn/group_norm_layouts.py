"""GroupNorm for the channels-last layout pass (flame/ir/passes/layouts.py): which
formulation an input takes, and the one that reads channels-last memory in order. Used by
``flame.nn.functional.group_norm`` while ``layouts.ENABLED`` is on (off by default: the
experiment of notes/performance.md, session 19)."""

from __future__ import annotations

from collections import deque

from flame import reductions as R
from flame.ir.infer import SizeValue
from flame.ir.ops import get_op
from flame.ir.passes.layouts import SOURCES, to_nchw
from flame.ir.shapes import prod
from flame.tensor import Tensor
from flame.views import permute, reshape


def _after_channels_last_conv(x: Tensor, limit: int = 64) -> bool:
    """Whether ``x`` is computed from a channels-last convolution's result (a conv plus
    bias, time embedding and residual, a skip join): the pass pipeline then keeps it
    channels-last (flame/ir/passes/layouts.py), so GroupNorm takes the formulation that reads
    that order. Looks at no more than ``limit`` producers."""
    if x.ndim < 3 or x.node.buffer is not None:
        return False
    queue, seen = deque([x.node]), set()
    while queue and len(seen) < limit:  # breadth first, through full-size values only
        node = queue.popleft()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if node.op == "permute" and node.attr("dims") == to_nchw(len(node.shape)):
            base = node.inputs[0]
            while base.op == "detach":  # no_grad and inference mode mark results so
                base = base.inputs[0]
            if base.op in SOURCES and dict(base.attrs).get("channels_last"):
                return True
        if node.op == "cat":  # a skip join: its pieces
            queue.extend(node.inputs)
        elif get_op(node.op).kind in ("elementwise", "movement"):
            # through adds, casts, detaches and views; not into broadcast operands (a time
            # embedding's MLP is no activation)
            queue.extend(child for child in node.inputs if child.numel == node.numel)
    return False


def _group_norm_channels_last(x: Tensor, num_groups: int, weight, bias, eps: float) -> Tensor:
    """GroupNorm of an ``x`` whose channels are innermost in memory (a channels-last conv's
    result): per-channel sums of x and x*x over the spatial positions (column sums, read in
    memory order), combined per group into the mean and variance, then one per-(sample,
    channel) scale and offset. Every pass over x walks it channels-last, and the result keeps
    that order for the next conv (no transposed copy either side, issue 21). The variance is
    E[x^2] - E[x]^2 in float32, clamped at 0."""
    batch, channels = x.shape[0], x.shape[1]
    per_group = (batch, num_groups, channels // num_groups)
    # 1/n is a kernel argument (a SizeValue, as in R.mean): a new resolution runs the same code
    count = prod(x.shape[2:]) * (channels // num_groups)
    inverse = SizeValue(1.0 / count, "1/n[group]")
    wide = x if x.dtype.itemsize >= 4 else x.float()  # statistics in float32 at least
    # summed over the positions of the channels-last view [N, *S, C] (the memory's own order:
    # a column sum whose warps read consecutive channels)
    last = permute(wide, (0, *range(2, x.ndim), 1))
    positions = tuple(range(1, x.ndim - 1))
    sums = reshape(R.plain_sum(last, positions), per_group)
    squares = reshape(R.plain_sum(last * last, positions), per_group)
    mean = R.plain_sum(sums, 2, keepdim=True) * inverse
    variance = (R.plain_sum(squares, 2, keepdim=True) * inverse - mean * mean).clamp(min=0.0)
    scale = (variance + eps).rsqrt()  # [N, G, 1]
    if weight is not None:
        scale = scale * reshape(weight, per_group[1:])  # [N, G, C/G]
    offset = -mean * scale
    if bias is not None:
        offset = offset + reshape(bias, per_group[1:])
    broadcast = (batch, channels) + (1,) * (x.ndim - 2)
    scale, offset = (reshape(v.expand(per_group), broadcast) for v in (scale, offset))
    return (wide * scale + offset).to(x.dtype)
