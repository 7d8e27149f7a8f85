#!/bin/bash
# Runs one part of the gpu tier (the whole tier takes longer than one device call).
# usage: notes/probes/gpu_tier_part.sh 1|2 OUTFILE   (part 1: the files before tests/test_gpu_ops.py)
part=$1; out=$2
files=$(python3 -m pytest --collect-only -q -m gpu -p no:randomly tests/ 2>/dev/null | grep :: | cut -d: -f1 | uniq)
split=$(echo "$files" | grep -n '^tests/test_gpu_ops.py$' | cut -d: -f1)
if [ "$part" = 1 ]; then sel=$(echo "$files" | head -n $((split - 1))); else sel=$(echo "$files" | tail -n +$split); fi
python3 -m pytest -q -m gpu -p no:randomly -p no:cacheprovider $sel > "$out" 2>&1
rc=$?; tail -5 "$out"; exit $rc
