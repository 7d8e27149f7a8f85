"""Fingerprints of the plans of bench.diffusion's UNet and DiT training steps, planned on the
CPU at 32x32 b64 and then 48x48 b64 as notes/probes/new_resolution_cpu.py plans them.

    FLAME_CACHE_DIR=DIR FLAME_PLAN_CACHE=0 .venv/bin/python notes/probes/plan_fingerprint_cpu.py \
        [unet] [dit]

Per model and shape: a hash over every plan of the call, and for the big plan (> 50 groups)
its hash and the running hash after each part: the nodes (op, attrs, dtype, shape, inputs by
position), the groups in order (kind, members, outputs, reasons), the launches (spec_key, grid,
block, args, writes, shapes, zeroing, shared memory) and library calls (op, attrs, slots,
views), then slots, releases, peak and the remat decision. Object addresses are left out of
reprs. Used to check that a faster pass plans the same (notes/plan-speed.md): compare a copy
of the tree with the pass's old version against one with the new, at the same moment (other
engineers' changes move the hashes). ``FP_ROOT``: the tree to import flame and bench from
(``git archive HEAD`` into a folder keeps others' uncommitted work out). ``big=[]`` means the
big plan failed (the traceback is printed above): two such runs "agree" on nothing.
"""

import hashlib
import os
import re
import sys
import time

ROOT = os.environ.get(
    "FP_ROOT", os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "notes/probes"))

import first_step_cpu as probe  # noqa: E402
import new_resolution_cpu as nr  # noqa: E402

ADDR = re.compile(r" at 0x[0-9a-f]+")


def clean(text):
    return ADDR.sub("", text)


def describe_node(node, number):
    return (
        node.op,
        clean(repr(node.attrs)),
        node.dtype.name,
        node.shape,
        tuple(number.get(id(c), ("in", c.op, c.shape, c.dtype.name)) for c in node.inputs),
    )


def plan_fingerprint(plan):
    from flame.codegen.render import spec_key
    from flame.runtime.launch import Launch

    nodes = plan.graph.nodes
    number = {id(n): i for i, n in enumerate(nodes)}
    h = hashlib.sha256()
    parts = []
    for node in nodes:
        h.update(clean(repr(describe_node(node, number))).encode())
    parts.append(h.hexdigest()[:6])
    for group in plan.graph.groups:
        h.update(
            repr(
                (
                    group.kind,
                    tuple(number[id(n)] for n in group.nodes),
                    tuple(number[id(n)] for n in group.outputs),
                    group.reasons,
                )
            ).encode()
        )
    parts.append(h.hexdigest()[:6])
    for step in plan.launches:
        if isinstance(step, Launch):
            item = (
                "launch",
                spec_key(step.spec),
                step.grid,
                step.block,
                repr(step.args),
                step.writes,
                repr(step.shapes),
                step.zeroed,
                step.shared_bytes,
            )
        else:
            item = (
                type(step).__name__,
                repr(
                    getattr(step, "node", None)
                    and (step.node.op, step.node.attrs, step.node.shape, step.node.dtype.name)
                ),
                getattr(step, "inputs", None),
                getattr(step, "output", None),
                repr(getattr(step, "views", None)),
            )
        h.update(clean(repr(item)).encode())
    parts.append(h.hexdigest()[:6])
    h.update(
        repr((plan.slot_count, plan.output_slots, plan.releases, plan.planned_peak_bytes)).encode()
    )
    r = plan.graph.remat
    if r is not None:
        h.update(
            repr(
                (
                    r.without,
                    r.with_saves,
                    r.kept,
                    [(number.get(id(e[0])), e[1:]) for e in r.saved],
                    [(number.get(id(e[0])), e[1:]) for e in r.recomputed],
                )
            ).encode()
        )
    parts.append(h.hexdigest()[:6])
    return h.hexdigest()[:16], len(plan.graph.groups), parts


def step(trainer, image, batch):
    import traceback

    import flame as fl
    from bench import diffusion as bd

    with fl.backend("reference"):
        images, labels = bd.flame_batch(image, batch)
    probe.move_to_cuda()
    start = time.perf_counter()
    with fl.backend("cuda"):
        try:
            trainer.compiled(images, labels)
        except Exception:
            traceback.print_exc()
    return time.perf_counter() - start


def main():
    models = sys.argv[1:] or ["unet", "dit"]
    os.environ["FLAME_SIBLING_CLASSES"] = "0"
    import flame as fl
    from bench import diffusion as bd
    from flame.runtime import executor

    timings, loads = {}, []
    probe.patch_gpu_away(timings)
    nr.record_loads(loads)
    probe.record_passes(timings)
    rows = []
    nr.record_siblings(rows)
    probe.direct_writes_as_on_gpu(timings)
    plans = []
    inner = executor.Executor._plan

    def plan(self, pending, inputs):
        result = inner(self, pending, inputs)
        plans.append(plan_fingerprint(result))
        return result

    executor.Executor._plan = plan
    for model in models:
        with fl.backend("reference"):
            trainer = bd.flame_trainer((model, "full", 32, 64))
        for image, batch in ((32, 64), (48, 64)):
            del plans[:]
            step(trainer, image, batch)
            total = hashlib.sha256(repr(plans).encode()).hexdigest()[:16]
            big = [p for p in plans if p[1] > 50]
            print(f"{model} {image}x{image}b{batch}: {total} n={len(plans)} big={big} "
                  f"from {os.path.dirname(fl.__file__)}", flush=True)  # fmt: skip


main()
