#!/bin/bash
# Session 36 call 1: GEMV tiles at 33-64 rows (sweep), engine fused max 32 vs 64 at 32-64 rows, verify batch-1 A/B.
set -u
OUT=${OUT:-/tmp/out}
for w in .whl-mtp/*.whl .whl-slim/*.whl; do python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$w" >/dev/null 2>&1; done
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . >/dev/null 2>&1 || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,power.limit,temperature.gpu --format=csv,noheader
echo "== gemv sweep $(date +%T)"
timeout 240 python3 benchmarks/gemv_bench.py --no-progress --batches 40,48,64 --sweep-batches 40,48,64 --sweep-stages 3,4 \
  --sweep-warps 4,8 --json "$OUT/gemv.json" 2>&1 | tee "$OUT/gemv.txt" | tail -30
for f in 32 64; do
  echo "== engine fused max $f $(date +%T)"
  timeout 150 python3 benchmarks/engine_bench.py --device cuda --no-progress --fused-gemv-max-tokens $f \
    --batches 32,36,40,48,64 --prefill-splits 1 --reps 1 --no-prefill-continued --mixed-batch 0 \
    --out "$OUT/engine_f$f" 2>&1 | grep -E "^\| *[0-9]+ \||^Preset|rror" | head -12
done
echo "== end $(date +%T)"
