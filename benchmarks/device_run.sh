#!/usr/bin/env bash
# One device call: install the carried wheels and Baton, run the GPU tests and the benchmarks, print tables.
# Usage (device tool, carry [".whl"]): bash benchmarks/device_run.sh
# MTP benchmark only: MTP_ONLY=1 bash benchmarks/device_run.sh, carry [".whl-mtp"], filled here with
#   pip download safetensors tokenizers tqdm --no-deps --only-binary=:all: --python-version 3.12 \
#     --platform manylinux2014_x86_64 -d .whl-mtp
# Serving sweep only (2 GPUs): SERVING_PRESET=8b-like bash benchmarks/device_run.sh, carry [".whl-slim",
#   ".whl-serve"] (nixl-cu13 + nixl + msgspec; grpcio/protobuf new enough for the committed stubs); RATES,
#   SERVING_ARGS and ENGINE_ARGS override the defaults below.
set -uo pipefail
export PYTHONUNBUFFERED=1
for w in .whl/*.whl .whl-mtp/*.whl .whl-slim/*.whl .whl-serve/*.whl; do
  [ -e "$w" ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$w"
done
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/site . || exit 1
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ -n "${SERVING_PRESET:-}" ]; then
  # The 8b-like model's fp32 SSM state is 96 MiB per request: a 32 GiB pool holds 128 requests' state + KV.
  python3 benchmarks/serving_bench.py --out "$OUT/serving_$SERVING_PRESET" --model-preset "$SERVING_PRESET" \
    --rates "${RATES:-auto}" --no-progress ${SERVING_ARGS:---prompt-min 1024 --prompt-max 4096 --output-min 128 --output-max 512 --slo-tpot-ms 50} \
    --engine-args "${ENGINE_ARGS:---device cuda --dtype bfloat16 --max-num-seqs 128 --max-num-batched-tokens 2048 --cache-memory-mb 32768 --max-model-len 16384}" \
    2>&1 | tail -60
  exit 0
fi
if [ -n "${MTP_ONLY:-}" ]; then
  python3 benchmarks/mtp_bench.py --device cuda --out /tmp/mtp-bench --seconds 120 --prompts 8 --max-tokens 64 \
    --k-max 4 --no-progress --json "$OUT/mtp.json" 2>&1 | tee "$OUT/mtp.txt" | tail -32
  exit 0
fi
# Only the files with gpu tests: the machine's grpcio may be older than the committed stubs need.
python3 -m pytest -q -m gpu -p no:cacheprovider $(grep -l "mark.gpu" tests/test_*.py) 2>&1 | tail -5 | tee "$OUT/gpu_tests.txt"
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  python3 benchmarks/transfer_bench.py --device cuda 2>&1 | grep -v "NIXL INFO" | tee "$OUT/transfer_cuda.txt"
fi
python3 benchmarks/transfer_bench.py --device cpu --reps 3 2>&1 | grep -v "NIXL INFO" | tail -9 | tee "$OUT/transfer_cpu.txt"
