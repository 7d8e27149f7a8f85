"""A/B on the CPU plan: a library call's operand view stops at values the plan already writes.

    PYTHONPATH=. .venv/bin/python notes/probes/library_view_stop_ab_cpu.py --model dit \
        --batch 64 --json /tmp/dit_stop.json [--profile ...]   (step_kernel_bytes_cpu.py's options)

Today ``library_views.library_view`` resolves a matmul operand's movement chain all the way to
its base, through values the fusion pass already chose to write. The DiT's dq/dk/dv are joined
(``cat`` [3, B, H, S, D]), permuted to [B, S, 3, H, D] and written (the reshape rule of
materialize.py chose the permute); the matmuls then read ``reshape(permute, [B*S, 1152])``,
which is not a strided view of the ``cat``, so materialize.py writes the reshape too: a copy of
a contiguous buffer into the same layout (``flame_ew_copy_982da2c850``), once per matmul. Same
for the attention output ([B, S, H, D] written, then copied to [B, S, 384] and tile-transposed
to [384, B*S] for the projection's dW).

Here (probe only: the functions are re-executed from their own source with one call changed)
the three places that resolve a library operand stop at written values: materialize.py
(``chosen``), ``library_views.materialized_reads`` (``materialized``) and
``plans.LibraryCall.plan`` (``slot_of``). Where the chain is no view of its base, the value
nearest the base that makes it one is written (``lowest_viewable``, ``PROBE_LOWEST=1``, the
default) instead of the operand itself.
Prints the planned bytes and the kernels that went.

Since then the stop is in the code (``library_view``'s ``written``; materialize.py,
``materialized_reads`` and ``LibraryCall.plan`` pass the written values): on such a tree this
probe patches nothing and prints the plan as it is. ``lowest_viewable`` did not go in: with
the stop, materialize.py's reshape rule has already written the permute under
``reshape(permute(cat))``, and the DiT b64 plan was the same with and without it (790 kernels,
19.90 GB, ``PROBE_LOWEST=0`` and ``=1``).
"""

from __future__ import annotations

import inspect
import os
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "notes", "probes"))


def stop_view(node, stop):
    """``library_view(node)`` that does not look through a movement value in ``stop``
    (ids of values the plan writes): the library reads that value's memory through the
    rest of the chain."""
    from flame.ir.passes.library_views import own_view
    from flame.ir.views import MOVEMENT_OPS, resolve

    if node.op not in MOVEMENT_OPS:
        return None
    resolved = resolve(node, own_view, lambda m: m is node or id(m) not in stop)
    if resolved is None:
        return None
    return resolved  # library_view's computed=True: any written value may be the base


def lowest_viewable(node, stop):
    """The movement value nearest the base under ``node`` whose written layout makes
    ``node`` a strided view of it (the permute under ``reshape(permute(cat))``): writing that
    one serves every reader of the chain; ``node`` itself when none does."""
    from flame.ir.passes.library_views import own_view
    from flame.ir.views import MOVEMENT_OPS, resolve

    chain, value = [], node
    while value.op in MOVEMENT_OPS and (value is node or id(value) not in stop):
        chain.append(value)
        value = value.inputs[0]
    for candidate in reversed(chain):  # nearest the base first
        if candidate.op == "expand":
            continue
        follow = lambda m, c=candidate: m is not c and (m is node or id(m) not in stop)  # noqa: E731
        resolved = resolve(node, own_view, follow)
        if resolved is not None and resolved[0] is candidate:
            return candidate
    return node


def patch() -> None:
    from flame.ir.passes import fuse, library_views, materialize, row_columns
    from flame.runtime import plans

    if "written" in inspect.signature(library_views.library_view).parameters:
        print("library operands already stop at written values: nothing patched")
        return

    def rebuilt(function, old, new, namespace):
        source = textwrap.dedent(inspect.getsource(function))
        assert old in source, (function, old)
        namespace["stop_view"] = stop_view
        exec(compile(source.replace(old, new), f"<patched {function.__name__}>", "exec"),
             namespace)  # fmt: skip

    source_old = 'choose(child, f"input of {node.op}, which reads memory")'
    materialize.__dict__["lowest_viewable"] = lowest_viewable
    function = materialize.materialized_values
    text = textwrap.dedent(inspect.getsource(function))
    assert source_old in text and "view = library_view(child)" in text
    text = text.replace("view = library_view(child)", "view = stop_view(child, chosen)")
    if os.environ.get("PROBE_LOWEST", "1") == "1":
        lowest = source_old.replace("choose(child", "choose(lowest_viewable(child, chosen)")
        text = text.replace(source_old, lowest)
    materialize.__dict__["stop_view"] = stop_view
    exec(compile(text, "<patched materialized_values>", "exec"), materialize.__dict__)
    fuse.materialized_values = materialize.materialized_values  # imported by name
    rebuilt(library_views.materialized_reads, "view = library_view(child)",
            "view = stop_view(child, materialized)", library_views.__dict__)  # fmt: skip
    for module in (fuse, row_columns):
        module.materialized_reads = library_views.materialized_reads
    namespace = dict(plans.__dict__)
    rebuilt(plans.LibraryCall.plan.__func__, "base, view = library_view(child)",
            "base, view = stop_view(child, slot_of)", namespace)  # fmt: skip
    plans.LibraryCall.plan = namespace["plan"]


if __name__ == "__main__":
    patch()
    import step_kernel_bytes_cpu

    step_kernel_bytes_cpu.main()
