#!/bin/bash
# Session 36 call 4: 64-row blocks, wide N / short K / split K, against cuBLAS at 40 and 64 rows.
set -u
OUT=${OUT:-/tmp/out}
for w in .whl-mtp/*.whl .whl-slim/*.whl; do python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$w" >/dev/null 2>&1; done
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . >/dev/null 2>&1 || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
echo "== gemv $(date +%T)"
timeout 560 python3 benchmarks/gemv_bench.py --batches 40,64 --sweep-batches 40,64 --sweep-stages 3,4 \
  --sweep-block-m 64 --sweep-block-n 64,128,256 --sweep-block-k 64,128 --sweep-warps 4,8 --sweep-split-k 1,2,4 \
  --json "$OUT/gemv.json" 2>&1 | tee "$OUT/gemv.txt" | tail -24
echo "== end $(date +%T)"
