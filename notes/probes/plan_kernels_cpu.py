import sys, numpy as np, flame as fl
from collections import Counter
from flame.ir.graph import Graph
from flame.ir.passes import run_pipeline
from flame.ir.passes.library_views import library_view
from examples.diffusion.models import build_model
F = fl.nn.functional
name, size = sys.argv[1], sys.argv[2]
sys.path.insert(0, "notes/probes")
import first_step_cpu
with fl.backend("reference"):
    fl.manual_seed(0)
    model = build_model(name, 32, 3, 10, size)
first_step_cpu.move_to_cuda()
from flame.runtime import launch
from flame.runtime.device import DeviceInfo
launch.device_info = lambda: DeviceInfo("x", "sm_90", 132, 50 * 2**20)
with fl.backend("cuda"):
    params = list(model.parameters())
    B = int(__import__("os").environ.get("B", 4)); x = fl.randn(B, 3, 32, 32); t = fl.randint(0, 1000, (B,)); y = fl.randint(0, 10, (B,))
    with fl.autocast("cuda", dtype=fl.bfloat16):
        out = model(x, t, y)
    loss = (out.float() - x).square().mean()
    loss.backward(create_graph=True); grads = [p.grad for p in params]
    graph = run_pipeline(Graph(tuple(v.node for v in [loss, *grads])))
    ops = Counter(); odd = Counter()
    for g in graph.groups:
        if g.kind != "library": continue
        n = g.nodes[0]; ops[n.op] += 1
        for c in n.inputs:
            v = library_view(c)
            if v is None: continue
            strides, shape = v[1].strides, c.shape
            contiguous = list(strides) == [int(np.prod(shape[i+1:])) for i in range(len(shape))] and v[1].offset == 0
            if not contiguous:
                odd[(n.op, c.op, v[0].op)] += 1
    print(ops); print(odd)
    from flame.codegen.lower import lower_group
    from flame.runtime.executor import _layout_of
    wanted = sys.argv[3:]
    names = Counter()
    for g in graph.groups:
        if g.kind == "library": continue
        spec = lower_group(g, _layout_of).spec
        names[spec.name] += 1
        if any(w in spec.name for w in wanted):
            print(spec.name, spec.size_class, g.reasons[:2])
            print("   ", [ (n.op, n.shape, n.dtype.name, [(c.op, c.shape, dict(c.attrs).get("dims")) for c in n.inputs]) for n in g.nodes if n.op not in ("expand",)][:8])
            print("   out", [(o.shape, o.dtype.name) for o in g.outputs])
            n = g.outputs[0]
            for _ in range(8):
                print("      chain", n.op, n.shape, dict(n.attrs) if n.op != "attention_backward" else "", n.dtype.name)
                if not n.inputs: break
                n = n.inputs[0]
    print([n for n in names if any(w in n for w in wanted)])
