#!/bin/bash
set -u
OUT=${OUT:-/tmp/out}
for w in .whl-mtp/*.whl .whl-slim/*.whl; do python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$w" >/dev/null 2>&1; done
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . >/dev/null 2>&1 || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
for side in new old; do
  echo "== $side $(date +%T)"
  timeout 95 python3 .ab/probe/fused_spec.py $side --device cuda --no-progress --ks 1,3 --batches 12,24 \
    --acceptance 1.58,2.0,2.3 --out "$OUT/spec_$side" 2>&1 | grep -E "^(old|new)|^\| *[0-9] " | head -8
done
echo "== end $(date +%T)"
