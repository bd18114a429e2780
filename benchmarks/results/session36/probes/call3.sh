#!/bin/bash
# Session 36 call 3: 33-64 rows as two 32-row blocks side by side (tree) vs cuBLAS (fused max 32).
set -u
OUT=${OUT:-/tmp/out}
for w in .whl-mtp/*.whl .whl-slim/*.whl; do python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$w" >/dev/null 2>&1; done
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . >/dev/null 2>&1 || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
echo "== gemv $(date +%T)"
timeout 200 python3 benchmarks/gemv_bench.py --no-progress --batches 32,40,64 --sweep-batches 40,64 --sweep-stages 3,4 \
  --json "$OUT/gemv.json" 2>&1 | tee "$OUT/gemv.txt" | tail -30
for f in 64 32 64; do
  echo "== engine fused max $f $(date +%T)"
  timeout 120 python3 benchmarks/engine_bench.py --device cuda --no-progress --fused-gemv-max-tokens $f \
    --batches 32,33,36,40,48,64 --prefill-splits 1 --reps 1 --no-prefill-continued --mixed-batch 0 \
    --out "$OUT/engine_f$f_$(date +%s)" 2>&1 | grep -E "^\| *[0-9]+ \||rror" | head -12
done
echo "== tests $(date +%T)"
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ops_triton_gemv.py 2>&1 | tail -4
echo "== end $(date +%T)"
