#!/bin/bash
# A/B of K=0 sampled decode steps: the old tree (eager draw after the logits graph) against this one (the draw's graph).
# Usage: OLD=<commit> ROUNDS=N SIDES="old new" bash .ab/probe/k0_ab.sh ; output under $OUT/k0_ab
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/k0_ab"
if [[ " ${SIDES:-old new} " == *" old "* ]]; then
  rm -rf /tmp/old_tree /tmp/site_old && mkdir -p /tmp/old_tree
  if [ -n "${OLD_DIR:-}" ]; then cp -r "$OLD_DIR"/. /tmp/old_tree/; else git archive "${OLD:?}" | tar -x -C /tmp/old_tree; fi
  (cd /tmp/old_tree && python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/site_old .) || exit 1
fi
MODES=${MODES:-$'0\n0.8\n0.8 0.95'}
for round in $(seq 1 "${ROUNDS:-1}"); do
  for side in ${SIDES:-old new}; do
    site=/tmp/site; tree=$PWD
    if [ "$side" = old ]; then site=/tmp/site_old; tree=/tmp/old_tree; fi
    while read -r t p; do
      args="--temperature $t${p:+ --top-p $p}"
      tag="${side}_r${round}_t${t}${p:+_p$p}"
      echo "-- round $round $side $args"
      (cd "$tree" && PYTHONPATH=$site timeout 300 python3 benchmarks/spec_bench.py --device cuda --no-progress --ks 0 \
        --batches "${BATCHES:-1,8,32}" $args --out "$OUT/k0_ab/$tag" 2>&1 | grep -E "^\| *0 |apture" | head -8)
    done <<< "$MODES"
  done
done
