#!/bin/bash
set -u
OUT=${OUT:-/tmp/out}
for w in .whl-mtp/*.whl .whl-slim/*.whl; do python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$w" >/dev/null 2>&1; done
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . >/dev/null 2>&1 || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
i=0
for f in default 32 default 32; do
  i=$((i+1)); echo "== fused $f $(date +%T)"
  flag=""; [ "$f" != default ] && flag="--fused-gemv-max-tokens $f"
  timeout 100 python3 benchmarks/engine_bench.py --device cuda --no-progress $flag --batches 32,33,36,40,44,48,52 \
    --prefill-splits 1 --reps 1 --no-prefill-continued --mixed-batch 0 --out "$OUT/ab_${i}_$f" 2>&1 \
    | grep -E "^\| *[0-9]+ \||rror|fused_gemv" | sed 's/.*engine fused/engine fused/' | head -12
done
echo "== tests $(date +%T)"
timeout 330 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ops_triton_gemv.py tests/test_cuda_graphs.py \
  tests/test_kernels_in_engine.py tests/test_pdl.py tests/test_mixed_graphs.py tests/test_async_scheduling.py 2>&1 | tail -4 | tee "$OUT/gpu_tests.txt"
echo "== end $(date +%T)"
