#!/bin/bash
set -u
OUT=${OUT:-/tmp/out}
for w in .whl-mtp/*.whl .whl-slim/*.whl; do python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$w" >/dev/null 2>&1; done
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . >/dev/null 2>&1 || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,power.limit --format=csv,noheader
i=0
for s in 4 2 4 2; do
  i=$((i+1)); echo "== graphs every $s $(date +%T)"
  timeout 95 python3 .ab/probe37/sizes_ab.py $s --device cuda --no-progress --batches 33,34,36,37,38 \
    --prefill-splits 1 --reps 1 --no-prefill-continued --mixed-batch 0 --out "$OUT/sizes_${i}_$s" 2>&1 \
    | grep -E "^\| *[0-9]+ \||rror|graph sizes" | head -8
done
echo "== mixed 36 + 8/16 in Q=16, fused 64 $(date +%T)"
timeout 120 python3 benchmarks/engine_bench.py --device cuda --no-progress --batches 36 --fused-gemv-max-tokens 64 \
  --prefill-splits 1 --reps 1 --no-prefill-continued --mixed-batch 36 --mixed-prompt-tokens 8,16 --mixed-graph-tokens 16 \
  --out "$OUT/mixed" 2>&1 | tail -25
echo "== end $(date +%T)"
