#!/usr/bin/env bash
# A/B of prefill steps: OLD's baton against this tree's, alternated ROUNDS times, engine_bench prefill rows only.
set -u
OLD=${OLD:-ba90acd}
OUT=${OUT:-/tmp/out}
STAGES=none bash benchmarks/device_run.sh >/dev/null 2>&1 || { echo install failed; exit 1; }
rm -rf /tmp/old && mkdir -p /tmp/old && git archive "$OLD" | tar -x -C /tmp/old
(cd /tmp/old && python3 -m pip install -q --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site_old .) || exit 1
export PYTHONPATH=/tmp/site
echo "== gpu tests ($(date +%T))"
python3 -m pytest -q -m gpu -p no:cacheprovider ${GPU_TESTS:-tests/test_mixed_graphs.py tests/test_cuda_graphs.py tests/test_async_scheduling.py tests/test_kernels_in_engine.py} 2>&1 | tail -4 | tee "$OUT/gpu_tests.txt"
for r in $(seq 1 ${ROUNDS:-2}); do
  for side in old new; do
    pp=/tmp/site; [ $side = old ] && pp=/tmp/site_old:/tmp/site
    echo "== $side round $r ($(date +%T))"
    PYTHONPATH=$pp python3 benchmarks/engine_bench.py --device cuda --no-progress --batches 1 --steps 5 \
      --prefill-splits 1,4 --reps ${REPS:-5} --no-prefill-continued --mixed-batch 0 --out "$OUT/eb_${side}_$r" 2>&1 \
      | grep -E "^\| [0-9]+ × |^copy"
  done
done
