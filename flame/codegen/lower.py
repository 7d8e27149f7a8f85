"""Group -> KernelSpec: picks the lowering for the group's kind; ``PlanLowering`` lowers the
groups of one plan, each distinct group once."""

from __future__ import annotations

from flame.codegen.elementwise import Lowered, lower_elementwise
from flame.ir.graph import Group, is_input
from flame.ir.node import exact
from flame.records import replace


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


class PlanLowering:
    """The groups of one plan lowered, a group equal to one lowered before taking its result
    over its own nodes. A UNet step's plan holds each ResBlock's kernels several times over
    (the same ops, shapes and layouts in another block): ~70 % of its ~1,300 lowerings
    repeat one made earlier in the plan.

    Two groups are equal when, numbering members by position and the values they read from
    outside by first use (as the kernel header does), every member has the same op, dtype,
    shape, attributes and inputs by number, the same members are written, and every value
    read from outside has the same dtype, shape and layout (``layout_of``), and the same op
    and attributes where it is a leaf computed in the kernel (a constant, an index). That is
    all lowering looks at; numbers in attributes compare as the code spells them (``exact``:
    -0.0 is not 0.0). Kept for one plan only: settings that change lowering between
    plans (a test's patched constant) never meet a result made under others."""

    def __init__(self, layout_of):
        self.layout_of = layout_of
        self._done: dict[tuple, tuple | None] = {}
        self.lowered = 0  # groups lowered
        self.repeated = 0  # groups that took an equal group's result

    def lower(self, group: Group) -> Lowered:
        canonical = self._canonical(group)
        if canonical is None:
            self.lowered += 1
            return lower_group(group, self.layout_of)
        key, nodes = canonical
        try:
            done = self._done.get(key)
        except TypeError:  # an attribute that does not hash: no key for this group
            self.lowered += 1
            return lower_group(group, self.layout_of)
        if done is not None:
            lowered, reads, outputs = done
            self.repeated += 1
            return replace(
                lowered, spec=replace(lowered.spec, header=_header(group)),
                reads=tuple(nodes[at] for at in reads),
                outputs=tuple(nodes[at] for at in outputs),
            )  # fmt: skip
        self.lowered += 1
        lowered = lower_group(group, self.layout_of)
        number = {id(node): at for at, node in enumerate(nodes)}
        reads = [number.get(id(node)) for node in lowered.reads]
        outputs = [number.get(id(node)) for node in lowered.outputs]
        if None not in reads and None not in outputs and key not in self._done:
            self._done[key] = (lowered, tuple(reads), tuple(outputs))
        return lowered

    def _canonical(self, group: Group) -> tuple[tuple, list] | None:
        """(key, nodes): the group's description above, and its members then its outside
        values in that numbering; None where an output is not a member."""
        number = {id(node): at for at, node in enumerate(group.nodes)}
        outside = []
        parts: list = [group.kind]
        for node in group.nodes:
            refs = []
            for child in node.inputs:
                at = number.get(id(child))
                if at is None:
                    at = number[id(child)] = len(group.nodes) + len(outside)
                    outside.append(child)
                refs.append(at)
            parts.append((node.op, node.dtype, node.shape, exact(node.attrs), tuple(refs)))
        written = [number.get(id(node)) for node in group.outputs]
        if None in written or any(at >= len(group.nodes) for at in written):
            return None
        parts.append(tuple(written))
        for node in outside:
            leaf = not node.inputs and not is_input(node)
            parts.append((
                node.dtype, node.shape, is_input(node), self.layout_of(node),
                (node.op, exact(node.attrs)) if leaf else None,
            ))  # fmt: skip
        return tuple(parts), [*group.nodes, *outside]


def _header(group: Group) -> tuple[str, ...]:
    from flame.codegen.common import header

    return header(group)
