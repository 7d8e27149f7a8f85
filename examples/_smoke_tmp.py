import numpy as np, flame as fl, time, traceback
from flame.runtime.reference import evaluate
t=time.time()
x = fl.randn(4096, 4096, seed=0)
b = fl.tensor(np.arange(4096, dtype=np.float32))
y = fl.gelu(x * 1.5 + b, approximate="tanh") * x.sigmoid() - 0.5 * x * x
out = y.numpy()
print("first", time.time()-t)
ref = evaluate([y.node], precision=np.float64, realized=False)[0]
print("err", np.abs(out-ref).max(), np.linalg.norm(out-ref)/np.linalg.norm(ref))
for dt in [fl.float16, fl.bfloat16, fl.int32, fl.int64, fl.bool_]:
    try:
        a = fl.tensor((np.random.rand(37, 5)*10).astype(np.float32)).to(dt)
        c = fl.tensor((np.random.rand(5)*10+1).astype(np.float32)).to(dt)
        if dt is fl.bool_:
            r = (a & c) | ~a
        else:
            r = (a + c) * a - c // c % 7 if dt.is_int else fl.exp(a/10) + c.sigmoid()
        g = r.numpy(); rf = evaluate([r.node], realized=False)[0]
        print(dt, np.abs(g.astype(np.float64)-rf.astype(np.float64)).max())
    except Exception:
        traceback.print_exc()
