"""Run a probe or bench module with module constants set, in this process only: an A/B of
FLAME's switches without editing the code.

    export FLAME_SWITCHES=flame.ir.passes.split.STRIPS_BY_THREADS=False
    PYTHONPATH=. python3 notes/probes/switches.py notes/probes/diffusion_step_case.py \
        dit full 32 64 flame

Each item is ``module.NAME=value`` (value parsed as a Python literal). Use a fresh
``FLAME_CACHE_DIR`` and ``FLAME_PLAN_CACHE=0`` so no stored plan of the other code is loaded.
"""

import ast
import importlib
import os
import runpy
import sys

for item in filter(None, os.environ.get("FLAME_SWITCHES", "").split(",")):
    target, _, text = item.partition("=")
    module_name, _, name = target.rpartition(".")
    module = importlib.import_module(module_name)
    if not hasattr(module, name):
        raise SystemExit(f"switches: {module_name} has no {name}")
    setattr(module, name, ast.literal_eval(text))
print(f"switches: {os.environ.get('FLAME_SWITCHES') or 'head'}", flush=True)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
