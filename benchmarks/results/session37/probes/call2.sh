#!/bin/bash
set -u
OUT=${OUT:-/tmp/out}
for w in .whl-mtp/*.whl .whl-slim/*.whl; do python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$w" >/dev/null 2>&1; done
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . >/dev/null 2>&1 || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
echo "== launch_probe $(date +%T)"
timeout 200 python3 benchmarks/launch_probe.py --no-progress --batches 34,38 --variants base,ssu.warps=1 --rounds 2 \
  --json "$OUT/launch_probe.json" 2>&1 | tail -12
i=0
for v in "4 40" "2 34" "2 40" "4 40" "2 34" "2 40"; do
  i=$((i+1)); echo "== every/one-warp $v $(date +%T)"
  timeout 80 python3 .ab/probe37/sizes_ab.py $v --device cuda --no-progress --batches 33,35,37,39 \
    --prefill-splits 1 --reps 1 --no-prefill-continued --mixed-batch 0 --out "$OUT/sizes_${i}_${v/ /_}" 2>&1 \
    | grep -E "^\| *[0-9]+ \||rror|graph sizes" | cut -c1-40 | head -6
done
echo "== end $(date +%T)"
