"""Bytes a UNet training step's FLAME kernels move, with the channels-last layout pass off and
on (flame/ir/passes/layouts.py), from the CUDA plan built on the CPU: per kind of kernel
(elementwise, row/column reduction, tiled transpose) and the conv operands cuDNN would
transpose (read through a view that is not contiguous memory).

    PYTHONPATH=. B=64 python notes/probes/layout_bytes_cpu.py [unet|dit] [train|infer]
"""

import os
import sys
from collections import Counter

import numpy as np

import flame as fl
from examples.diffusion.models import build_model
from flame.codegen.lower import lower_group
from flame.ir.graph import Graph
from flame.ir.passes import layouts, run_pipeline, split
from flame.ir.passes.library_views import library_view
from flame.runtime import launch
from flame.runtime.device import DeviceInfo
from flame.runtime.executor import _layout_of

sys.path.insert(0, os.path.dirname(__file__))
import first_step_cpu  # noqa: E402

launch.device_info = lambda: DeviceInfo("x", "sm_90", 132, 50 * 2**20)
name = sys.argv[1] if len(sys.argv) > 1 else "unet"
mode = sys.argv[2] if len(sys.argv) > 2 else "train"
batch = int(os.environ.get("B", 64))
with fl.backend("reference"):
    fl.manual_seed(0)
    model = build_model(name, 32, 3, 10, "full")
first_step_cpu.move_to_cuda()


def graph_of():
    with fl.backend("cuda"):
        x, t = fl.randn(batch, 3, 32, 32), fl.randint(0, 1000, (batch,))
        y = fl.randint(0, 10, (batch,))
        if mode == "infer":
            model.eval()
            with fl.inference_mode(), fl.autocast("cuda", dtype=fl.bfloat16):
                out = model(x, t, y)
            return Graph((out.node,))
        with fl.autocast("cuda", dtype=fl.bfloat16):
            out = model(x, t, y)
        loss = (out.float() - x).square().mean()
        loss.backward(create_graph=True)
        grads = [p.grad for p in model.parameters()]
        return Graph(tuple(v.node for v in [loss, *grads]))


def account(graph):
    planned = run_pipeline(graph)
    kinds, counts, transposed = Counter(), Counter(), 0
    for group in planned.groups:
        if group.kind == "library":
            node = group.nodes[0]
            if node.op in ("conv", "conv_data_grad"):
                resolved = library_view(node.inputs[0])
                if resolved is not None:
                    base, view = resolved
                    strides = [int(np.prod(base.shape[i + 1 :])) for i in range(len(base.shape))]
                    if tuple(view.strides) != tuple(strides):
                        transposed += node.inputs[0].numel * node.inputs[0].dtype.itemsize
            continue
        spec = lower_group(group, _layout_of).spec
        kind = spec.name.split("_")[1]
        members = {id(n) for n in group.nodes}
        reads = {id(c): c for n in group.nodes for c in n.inputs if id(c) not in members}
        read = sum(c.numel * c.dtype.itemsize for c in reads.values() if c.op != "const")
        written = sum(o.numel * o.dtype.itemsize for o in group.outputs)
        kinds[kind] += read + written
        counts[kind] += 1
    return kinds, counts, transposed


for enabled in (False, True):
    layouts.ENABLED = split.SPLIT_COLUMNS = enabled
    fl.manual_seed(0)
    kinds, counts, transposed = account(graph_of())
    total = sum(kinds.values())
    print(f"layouts {'on ' if enabled else 'off'}: {total / 1e6:8.1f} MB in {sum(counts.values())} "
          f"kernels; conv operands cuDNN transposes {transposed / 1e6:.1f} MB")
    for kind, size in kinds.most_common():
        print(f"    {kind:8s} {size / 1e6:8.1f} MB {counts[kind]:4d} kernels")
