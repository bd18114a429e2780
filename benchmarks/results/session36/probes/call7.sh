#!/bin/bash
set -u
OUT=${OUT:-/tmp/out}
for w in .whl-mtp/*.whl .whl-slim/*.whl; do python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$w" >/dev/null 2>&1; done
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . >/dev/null 2>&1 || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
echo "== gemv $(date +%T)"
timeout 400 python3 benchmarks/gemv_bench.py --batches 32,36,48 --sweep-batches 36,48 --sweep-stages 4,6,8 \
  --sweep-block-m 64 --sweep-block-n 32,64 --sweep-block-k 32,64 --sweep-warps 2,4 --sweep-split-k 1,2 \
  --json "$OUT/gemv.json" 2>&1 | tee "$OUT/gemv.txt" | grep -v "it/s\]\|s/it\]" | tail -32
echo "== end $(date +%T)"
