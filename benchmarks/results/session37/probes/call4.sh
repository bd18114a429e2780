#!/bin/bash
set -u
OUT=${OUT:-/tmp/out}
for w in .whl-mtp/*.whl .whl-slim/*.whl; do python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$w" >/dev/null 2>&1; done
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . >/dev/null 2>&1 || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
i=0
for v in 2 4 2 4; do
  i=$((i+1)); echo "== split target $v/SM $(date +%T)"
  timeout 100 python3 .ab/probe37/splits_ab.py $v --device cuda --no-progress --context 2560 --batches 16,32,36,40,48,64 \
    --prefill-splits 1 --reps 1 --no-prefill-continued --mixed-batch 0 --out "$OUT/splits_${i}_$v" 2>&1 \
    | grep -E "^\| *[0-9]+ \||rror" | cut -c1-44 | head -8
done
echo "== end $(date +%T)"
