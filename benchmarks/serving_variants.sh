#!/usr/bin/env bash
# (e) variants in one device call on one multi-GPU machine: each line of $VARIANTS, "NAME|RATES|ENGINE FLAGS|FLAGS",
# is one serving_bench.py run with the shared settings below (8b-like model, prompts 1,024-4,096 tokens, outputs
# 128-512, $DURATION_S (default 20) s of Poisson arrivals per rate, SLO TTFT <= 2 s and TPOT <= $TPOT_MS ms, every
# node's engine flags $E plus the line's ENGINE FLAGS, 1P1D's prefill node with an 8,192-token budget). FLAGS (shell
# words) go to serving_bench.py as given, e.g. --configs agg, or --disagg-decode-engine-args "--mixed-graph-tokens 128".
# Results under $OUT/NAME; each run's table rows are printed. DRY=1 prints the commands only.
#   VARIANTS=$'agg|10,13||--configs agg\ndisagg|16,18||--configs disagg' bash benchmarks/serving_variants.sh
# Carry .whl-slim and .whl-serve (benchmarks/device_run.sh).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
TPOT_MS=${TPOT_MS:-15}
# Goodput counts the drain after the last arrival in its window (serving_bench.py), a fixed few seconds that weigh
# more on a short trace and on the faster configuration: a longer one (e.g. 60) measures closer to steady state.
DURATION_S=${DURATION_S:-20}
E="--device cuda --dtype bfloat16 --max-num-seqs 128 --max-num-batched-tokens 2048 --cache-memory-mb 32768 --max-model-len 16384"
# The default: the aggregated pair and 1P1D at the engine's defaults over rates from well within to past their
# capacity (the summary's SLO sweep scores both from TPOT <= 6 ms up), and 1P1D taking the overflow on its decode
# node with mixed graphs of 128 at the rate where it pays (benchmarks/RESULTS.md, the serving history); it fits in
# one 10-minute device call on 2 x H200.
DEFAULT=$'agg|8,11,14||--configs agg
disagg|11,14,17||--configs disagg
disagg_ovf|17||--configs disagg --disagg-prefill-queue-limit-tokens 16384 --disagg-decode-engine-args "--mixed-graph-tokens 128"'
VARIANTS=${VARIANTS:-$DEFAULT}

if [ -z "${DRY:-}" ]; then
  STAGES=none bash benchmarks/device_run.sh >/dev/null 2>&1 || { echo "install failed"; exit 1; }
  export PYTHONPATH=/tmp/site
fi
status=0
while IFS='|' read -r name rates engine flags; do
  [ -z "$name" ] && continue
  eval "set -- $flags"  # the line's shell words, quotes respected
  cmd=(python3 benchmarks/serving_bench.py --out "$OUT/$name" --model-preset 8b-like --model-dir .bench-model/8b-like
       --log-dir "/tmp/serving-logs/$name" --no-progress --duration-s "$DURATION_S" --prompt-min 1024 --prompt-max 4096
       --output-min 128 --output-max 512 --slo-tpot-ms "$TPOT_MS" --engine-args "$E${engine:+ $engine}"
       --prefill-engine-args "--max-num-batched-tokens 8192" --rates "$rates" "$@")
  echo "== $name ($(date +%T))"
  if [ -n "${DRY:-}" ]; then
    printf '%q ' "${cmd[@]}"; echo
    continue
  fi
  timeout "${T:-190}" "${cmd[@]}" 2>&1 | grep -E "^\[|^\| (agg|disagg) " | grep -v "warm-up" || status=1
done <<< "$VARIANTS"
exit $status
