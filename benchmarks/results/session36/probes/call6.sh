#!/bin/bash
set -u
OUT=${OUT:-/tmp/out}
for w in .whl-mtp/*.whl .whl-slim/*.whl; do python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$w" >/dev/null 2>&1; done
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . >/dev/null 2>&1 || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
echo "== profile nopdl $(date +%T)"
BATON_PDL=0 timeout 240 python3 .ab/probe/patched.py benchmarks/step_profile.py --no-progress --batches 32,33,36 --steps 10 \
  --fused-gemv-max-tokens 64 --out "$OUT/profile" > "$OUT/profile.txt" 2>&1
grep -E "^batch|^\| [a-z]|^\| \`" "$OUT/profile.txt" | head -90
echo "== end $(date +%T)"
