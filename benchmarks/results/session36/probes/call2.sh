#!/bin/bash
# Session 36 call 2: where 32 -> 36 rows goes (profile), verify batch-1 one warp vs two.
set -u
OUT=${OUT:-/tmp/out}
for w in .whl-mtp/*.whl .whl-slim/*.whl; do python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$w" >/dev/null 2>&1; done
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . >/dev/null 2>&1 || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
echo "== profile $(date +%T)"
timeout 200 python3 benchmarks/step_profile.py --no-progress --batches 32,33,36 --steps 10 --out "$OUT/profile" 2>&1 \
  | tee "$OUT/profile.txt" | tail -60
echo "== ssu ab $(date +%T)"
BATCHES=1 KS=0,1,3 timeout 330 bash .ab/probe/ssu_ab.sh 2>&1 | tail -30
echo "== end $(date +%T)"
