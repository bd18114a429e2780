#!/bin/bash
set -u
OUT=${OUT:-/tmp/out}
for w in .whl-mtp/*.whl .whl-slim/*.whl; do python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$w" >/dev/null 2>&1; done
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . >/dev/null 2>&1 || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
i=0
for v in ${VARIANTS:-cub t64 t64s cub t64 t64s}; do
  i=$((i+1)); echo "== $v $(date +%T)"
  timeout 100 python3 .ab/probe/tiles_ab.py $v --device cuda --no-progress --batches ${BATCHES:-32,33,36,40,48,64} \
    --prefill-splits 1 --reps 1 --no-prefill-continued --mixed-batch 0 --out "$OUT/ab_${i}_$v" 2>&1 \
    | grep -E "^\| *[0-9]+ \||rror|^(cub|t64)" | head -12
done
echo "== end $(date +%T)"
