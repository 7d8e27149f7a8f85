import time, numpy as np, cupy as cp, flame as fl
from flame.runtime.executor import default_executor
def ev(fn, reps=30):
    fn(); cp.cuda.Device().synchronize()
    ts=[]
    for _ in range(reps):
        s=cp.cuda.Event(); e=cp.cuda.Event(); s.record(); fn(); e.record(); e.synchronize(); ts.append(cp.cuda.get_elapsed_time(s,e))
    return np.median(ts)
n=1<<26
x=fl.randn(n,seed=0).realize(); y=fl.randn(n,seed=1).realize()
def chain(): return (fl.gelu(x*1.5+y, approximate="tanh")*fl.sigmoid(y) - 0.5*x*x + fl.tanh(x-y)).realize()
print("chain ms", ev(chain))
# pure launch timing
plan = list(default_executor()._plans.values())[-1]
l = plan.launches[0]; print(l.name, l.grid, l.block)
xa = cp.random.rand(n, dtype=cp.float32); ya=cp.random.rand(n,dtype=cp.float32)
print("copy ms", ev(lambda: xa.copy()), "GB/s", 2*4*n/ev(lambda: xa.copy())/1e6)
X=fl.from_dlpack(cp.random.rand(8192,8192,dtype=cp.float32)).realize(); B=fl.from_dlpack(cp.random.rand(8192,dtype=cp.float32))
print("bias gelu ms", ev(lambda: fl.gelu(X+B, approximate="tanh").realize()))
print(open("/dev/null").close())
t=fl.from_dlpack(cp.random.rand(1024,dtype=cp.float32))
def tiny():
    a=t
    for i in range(5):
        a=(a*1.1+t).tanh().sigmoid()-t
    return a.realize()
tiny(); cp.cuda.Device().synchronize()
s=time.perf_counter()
for _ in range(1000): tiny()
cp.cuda.Device().synchronize(); print("tiny20 us/call", (time.perf_counter()-s)*1e3)
def build1000():
    a=t
    for i in range(250): a=(a*1.01+t).tanh()-t
    return a
build1000(); s=time.perf_counter(); build1000(); print("build us/op", (time.perf_counter()-s)*1e6/1000)
import cProfile, pstats
cProfile.run("for _ in range(300): tiny()", "/tmp/p"); pstats.Stats("/tmp/p").sort_stats("tottime").print_stats(12)
