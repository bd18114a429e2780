#!/usr/bin/env bash
# One device call: `baton up` on one GPU as a user starts it, with the 8b-like model and an MTP layer. Stages
# (STAGES, comma-separated, in this order), each printing its table; results land under $OUT:
#   memory   tests/test_memory_budget.py's GPU tests: pools sized from the GPU's memory, within the share
#   layouts  serve_check.py: the default (aggregated on one GPU) against 1P1D through CUDA IPC and through NIXL,
#            the same load each (LAYOUT_ARGS: serve_check flags, e.g. "--requests 256 --concurrency 64")
#   mtp      tests/test_gpu_serving.py: K = 0..3 through `baton up`, a few hundred concurrent requests, all complete
#            (MTP_K: a pytest -k expression choosing among them, e.g. "3")
#   demo     `baton demo` (make demo's command) on the GPU
#   nixl     1P1D through NIXL on the one GPU under UCX's default transports and two UCX_TLS choices
# Carry .whl-slim (nixl-cu13 without its unused modules, nixl, msgspec) and .whl-serve (grpcio, protobuf,
# prometheus-client, llguidance, hypercorn and its dependencies), as benchmarks/device_run.sh says. MODEL_DIR
# (default /tmp/m8) is built if absent.
set -uo pipefail
export PYTHONUNBUFFERED=1
for w in .whl-slim/*.whl .whl-serve/*.whl; do
  [ -e "$w" ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$w"
done
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . || exit 1
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
export BATON_COMMIT=${BATON_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
echo "commit $BATON_COMMIT"
OUT=${OUT:-/tmp/out}
M=${MODEL_DIR:-/tmp/m8}
mkdir -p "$OUT"
STAGES=",${STAGES:-memory,layouts,mtp},"
stage() { case "$STAGES" in *",$1,"*) echo "== $1 ($(date +%T))"; return 0 ;; esac; return 1; }
if [ ! -f "$M/config.json" ]; then
  start=$(date +%s)
  python3 -m baton.cli.main make-model "$M" --preset 8b-like --mtp-layers 1 --device cuda >/dev/null || exit 1
  echo "make-model 8b-like: $(( $(date +%s) - start )) s"
fi
if stage memory; then
  python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/test_memory_budget.py > "$OUT/memory.txt" 2>&1
  grep -E "^K=|passed|failed|Error" "$OUT/memory.txt"
fi
if stage layouts; then
  python3 benchmarks/serve_check.py --model "$M" --out "$OUT/layouts" ${LAYOUT_ARGS:-} --variants \
    'default|' 'p1d1-ipc|--prefill-workers 1' 'p1d1-nixl|--prefill-workers 1 --no-cuda-ipc' 2>&1 \
    | tee "$OUT/layouts.txt"
fi
if stage mtp; then
  BATON_SERVE_MODEL="$M" BATON_RESULTS_DIR="$OUT/mtp" python3 -m pytest -q -s -m gpu -p no:cacheprovider \
    ${MTP_K:+-k "$MTP_K"} tests/test_gpu_serving.py > "$OUT/mtp.txt" 2>&1
  grep -E "^K=|passed|failed|Error|assert" "$OUT/mtp.txt" | head -40
fi
if stage demo; then
  python3 -m baton.cli.main make-model /tmp/demo-small --preset small --seed 0 >/dev/null \
    && python3 -m baton.cli.main demo --model /tmp/demo-small 2>&1 | tail -6 | tee "$OUT/demo.txt"
fi
if stage nixl; then
  python3 benchmarks/serve_check.py --model "$M" --out "$OUT/nixl" --requests 64 --concurrency 16 --variants \
    'nixl-default|--prefill-workers 1 --no-cuda-ipc' \
    'nixl-ucx-ipc|--prefill-workers 1 --no-cuda-ipc|UCX_TLS=cuda_ipc,cuda_copy,sm,self,tcp' \
    'nixl-ucx-staged|--prefill-workers 1 --no-cuda-ipc|UCX_TLS=cuda_copy,sm,self,tcp' 2>&1 | tee "$OUT/nixl.txt"
fi
