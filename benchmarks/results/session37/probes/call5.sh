#!/bin/bash
set -u
OUT=${OUT:-/tmp/out}
for w in .whl-mtp/*.whl .whl-slim/*.whl; do python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$w" >/dev/null 2>&1; done
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . >/dev/null 2>&1 || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
echo "== capture $(date +%T)"
for s in 4 2; do timeout 90 python3 .ab/probe37/capture_time.py $s 2>&1 | grep -E "captured|rror" | tail -2; done
i=0
for v in "4 40" "2 34" "4 40" "2 34"; do
  i=$((i+1)); echo "== every/one-warp $v $(date +%T)"
  timeout 75 python3 .ab/probe37/sizes_ab.py $v --device cuda --no-progress --context 2560 --batches 33,34,37,38 \
    --prefill-splits 1 --reps 1 --no-prefill-continued --mixed-batch 0 --out "$OUT/ctx2560_${i}_${v/ /_}" 2>&1 \
    | grep -E "^\| *[0-9]+ \||rror" | cut -c1-44 | head -6
done
echo "== tests $(date +%T)"
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_cuda_graphs.py tests/test_ops_triton_ssu.py \
  tests/test_pdl.py tests/test_async_scheduling.py tests/test_ops_triton_attention.py 2>&1 | tail -3 | tee "$OUT/gpu_tests.txt"
echo "== end $(date +%T)"
