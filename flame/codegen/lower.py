"""Group -> KernelSpec: picks the lowering for the group's kind."""

from __future__ import annotations

from flame.codegen.elementwise import Lowered, lower_elementwise
from flame.ir.graph import Group


def lower_group(group: Group, layout_of) -> Lowered:
    if group.kind == "elementwise":
        from flame.codegen.transpose import lower_transposing

        return lower_transposing(group, layout_of) or lower_elementwise(group, layout_of)
    if group.kind == "reduce":
        # imported here: a process whose first kernels are elementwise (a warm start's first
        # result) does not pay for the four reduction modules
        from flame.codegen.reduce import lower_reduce

        return lower_reduce(group, layout_of)
    raise ValueError(f"no lowering for {group.kind} groups")
