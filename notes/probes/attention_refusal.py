"""Why cuDNN refuses the attention backward in the bench's compiled step (prints refusals)."""

import numpy as np

import flame as fl
import flame.nn.functional as F
from flame.runtime import library_attention

rng = np.random.default_rng(0)
shape = (4, 16, 1024, 64)
q, k, v, go = [
    fl.tensor(rng.standard_normal(shape).astype(np.float32)).to(fl.bfloat16).realize()
    for _ in range(4)
]
for t in (q, k, v):
    t.requires_grad_()


@fl.compile
def step(q, k, v, go):
    out = F.scaled_dot_product_attention(q, k, v, is_causal=False)
    out.backward(go)
    return out


for mode in ("compiled", "lazy"):
    try:
        if mode == "compiled":
            step(q, k, v, go)
        else:
            out = F.scaled_dot_product_attention(q, k, v)
            out.backward(go)
            fl.realize(q.grad)
        print(mode, "ok")
    except Exception as error:  # noqa: BLE001
        print(mode, "failed:", str(error)[:300])
    for key, reason in library_attention._REFUSED.items():
        print("REFUSED", key[0], key[2], "\n", reason[:3000])
    library_attention._REFUSED.clear()
