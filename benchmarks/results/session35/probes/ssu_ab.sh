#!/bin/bash
# Verify state update: one warp (tree) against two (old), in whole spec steps, then the kernel's GPU tests, then tiles.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/spec_ab"
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . >/dev/null 2>&1 || exit 1
export PYTHONPATH=/tmp/site
for side in ${SIDES:-old new}; do
  echo "-- $side"
  timeout 150 python3 .ab/probe/spec_ab.py $side --device cuda --no-progress --ks ${KS:-0,1,3} --batches ${BATCHES:-8,32} \
    --acceptance 1.58,2.0,2.3 --out "$OUT/spec_ab/$side" 2>&1 | grep -E "^(old|new)|^\| *[0-9] " | head -12
done
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ops_triton_ssu.py 2>&1 | tail -2
