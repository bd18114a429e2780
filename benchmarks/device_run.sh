#!/usr/bin/env bash
# One device call: install the carried wheels and Baton, then run the stages named in STAGES (comma-separated,
# in this order), each printing its table; results land under $OUT.
#   tests     pytest -m gpu (files with gpu tests only: the machine's grpcio may be older than the stubs need)
#   engine    engine_bench.py: (a) decode step vs traffic roofline, (c) prefill vs matmul rate, mixed steps (8b-like,
#             ~45 GB; ENGINE_BENCH_ARGS, e.g. "--batches 64 --prefill-splits 1 --mixed-prompt-tokens 128,512,2048",
#             or "--preset qwen3.5-27b-like" for Qwen3.5's shape)
#   fp8       engine_bench.py --compare-fp8: FP8 weights (block-wise 128x128 as the FP8 checkpoints ship, per tensor)
#             and the FP8 KV cache against bf16 in the same run, decode at batch 1, 32, 256 and prefill 1 x 8192, on
#             8b-like then nano-30b-a3b-like (FP8_PRESETS restricts them, e.g. "8b-like"), each preset under
#             `timeout ${FP8_TIMEOUT:-270}` s; FP8_ARGS: flags after the defaults (e.g. "--compare-fp8 fp8-block")
#   fp8gemm   fp8_gemm_bench.py: FP8 GEMV and block-scaled GEMM (tuning table + sweep) against bf16 at the 8b-like
#             layer shapes, M = 1, 32, 256, 8192 (FP8GEMM_ARGS, e.g. "--batches 1,8192 --no-sweep")
#   moe       moe_bench.py: the fused MoE vs the per-expert loop and a dense GEMM, then its FP8 experts (MOE_FP8, default
#             "block"; "per-tensor") beside bf16, at Nemotron-3-Nano's expert shapes (MOE_ARGS, e.g. "--shape qwen-next")
#   profile   step_profile.py: a decode step's kernels by kind at batch 1, 32, 256 (where (a)'s gap goes); PROFILE_ARGS,
#             e.g. "--prefill 1x8192,4x2048 --no-decode" (where a prefill step's time goes: (c), and (e)'s 1P1D bound)
#   ab        kernel_ab.py: the prefill-path kernels (varlen conv, prefill and decode attention) against AB_REV's
#   launch    launch_probe.py: launch settings A/B'd in whole decode steps (LAUNCH_ARGS, default: the tree against
#             the decode settings it replaced, at batch 40 and 256)
#   gemv      gemv_bench.py: the fused-prologue GEMV vs separate op + cuBLAS on the 8b-like layers (tile sweep;
#             GEMV_ARGS, e.g. "--batches 1 --sweep-batches 1 --sweep-stages 1,2,3,4")
#   fused     engine_bench.py and step_profile.py again with --fused-gemv-max-tokens ${FUSED_MAX:-32} (A/B of (a))
#   pdl       engine_bench.py at batch 1 and 32, fused GEMVs off / on (FUSED_MAX, default 1) x BATON_PDL=0 / 1
#   scan      scan_bench.py: (b) our chunked scan vs state-spaces/mamba's (carry .ref: fetch_reference.sh)
#   kernels   kernels_bench.py: state / conv update vs copy bandwidth (CUDA graphs of 100 launches)
#   gdn       gdn_bench.py: (#48 b) our Gated DeltaNet chunked prefill vs flash-linear-attention's, decode vs copy
#             bandwidth (carry .whl-fla, see below; GDN_ARGS, e.g. "--split-scan": both prefill second stages)
#   sampling  sampling_bench.py: a step's sampled rows, the kernels vs the torch sort-based reference (SAMPLING_ARGS)
#   samplingcost  sampling_cost_bench.py: (#52 7) 8b-like decode steps at batch 1, 32, 256 with penalties + min-p +
#             logprobs against plain sampling, one engine (SAMPLINGCOST_ARGS, e.g. "--batches 256 --steps 40")
#   mtp       mtp_bench.py: (d) trains the MTP checkpoint, then K = 0..4 (carry .whl-mtp, see below)
#   spec      spec_bench.py: (d) on SPEC_PRESET (default 8b-like; "qwen3.5-27b-like" for Qwen3.5's shape, #48 6(d)):
#             verify steps (K = 1..4) against decode steps at batch 1, 8, 32, and the speedup at the mtp stage's
#             acceptance lengths (run mtp first, or SPEC_ARGS="--acceptance ...")
#   transfer  transfer_bench.py on cuda (2 GPUs: NIXL state slot first and as one READ, and CUDA IPC; progress delay 1000
#             and 0 us, PROGRESS_DELAYS; block ids contiguous, served / served-lowest, scattered) and on cpu
#   serving   serving_bench.py: (e) 1P1D vs 2 aggregated replicas (2 GPUs; carry .whl-slim and .whl-serve); several
#             configurations in one call: benchmarks/serving_variants.sh
#   multiturn multiturn_bench.py --gpu: (#51 4) multi-turn chat, prefix cache on vs off, aggregated and 1P1D on one GPU
#             (carry .whl-slim and .whl-serve; MULTITURN_ARGS, e.g. "--conversations 64 --configs agg-cache,agg-nocache")
#   variants  kernel_variants.py --device cuda: the Triton kernel specializations a multi-turn workload meets after the
#             warm-up, each a compile inside a step (VARIANTS_ARGS, e.g. "--preset 8b-like --role prefill ...")
#   ncu       Nsight Compute on NCU_CMD's kernels matching the regex NCU_KERNELS (NCU_COUNT launches, default 3): speed
#             of light, occupancy, launch, warp stall and memory sections; the whole report in $OUT/ncu.txt
#             (e.g. NCU_KERNELS="_wy_(solve|wu)_kernel" NCU_CMD="benchmarks/gdn_bench.py --batches 1 --calls 1")
#   commits   the tree against REV_A: greedy_tokens.py's tokens on every step path, then engine_bench.py A then B
# Default STAGES=tests,engine,transfer. Usage (device tool): STAGES=... bash benchmarks/device_run.sh
# Wheels: .whl-slim (nixl-cu13 + nixl + msgspec), .whl-serve (grpcio==1.85.1 protobuf==7.35.1 for the committed stubs,
#   prometheus-client, llguidance, and the router's HTTP server: hypercorn h11 h2 hpack hyperframe priority wsproto),
#   both under the device tool's 64 MiB only with nixl-cu13's unused modules dropped from its wheel:
#   zip -d .whl-slim/nixl_cu13-*.whl 'nixl_ep_cu13/*' 'nixl_cu13.libs/ucx/libucx_perftest_cuda*'   (59 -> 37 MB)
#   .whl-mtp: pip download safetensors tokenizers tqdm --no-deps --only-binary=:all: --python-version 3.12 \
#     --platform manylinux2014_x86_64 -d .whl-mtp
#   .whl-fla: pip download fla-core==0.6.0 flash-linear-attention==0.6.0 --no-deps -d .whl-fla
# serving: SERVING_PRESET (default 8b-like), RATES (default auto), SERVING_ARGS and ENGINE_ARGS override the
#   defaults below; PREFILL_ARGS: extra engine flags of disagg's prefill node (e.g. '--max-num-batched-tokens 8192'),
#   DECODE_ARGS: of disagg's decode node;
#   MODEL_DIR (default .bench-model/PRESET). Node logs stay in /tmp/serving-logs.
set -uo pipefail
export PYTHONUNBUFFERED=1
for w in .whl/*.whl .whl-mtp/*.whl .whl-slim/*.whl .whl-serve/*.whl .whl-fla/*.whl; do
  [ -e "$w" ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$w"
done
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . || exit 1
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu --format=csv,noheader
echo "commit ${BATON_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
STAGES=",${STAGES:-tests,engine,transfer},"
gpus=$(nvidia-smi -L | wc -l)
stage() { case "$STAGES" in *",$1,"*) echo "== $1 ($(date +%T))"; return 0 ;; esac; return 1; }

if stage tests; then
  # GPU_TESTS: a subset of the files (default: every file with gpu tests)
  python3 -m pytest -q -m gpu -p no:cacheprovider ${GPU_TESTS:-$(grep -l "mark.gpu" tests/test_*.py)} 2>&1 | tail -8 \
    | tee "$OUT/gpu_tests.txt"
fi
if stage engine; then
  python3 benchmarks/engine_bench.py --device cuda --no-progress ${ENGINE_BENCH_ARGS:-} --out "$OUT/engine" 2>&1 | tail -36
fi
if stage fp8; then
  for preset in $(echo "${FP8_PRESETS:-8b-like,nano-30b-a3b-like}" | tr , ' '); do
    # Block-wise first (what the FP8 checkpoints ship: a timeout keeps its rows); per tensor too on the dense preset,
    # the MoE one's weights being mostly routed experts, which stay bf16 in either format.
    case $preset in nano-30b-a3b-like) variants=fp8-block,fp8-block+kv-fp8 ;; *) variants=fp8-block,fp8-block+kv-fp8,fp8 ;; esac
    echo "-- $preset ($(date +%T))"
    timeout "${FP8_TIMEOUT:-270}" python3 benchmarks/engine_bench.py --device cuda --no-progress --preset "$preset" \
      --compare-fp8 "$variants" ${FP8_ARGS:-} --out "$OUT/fp8_$preset.json" 2>&1 | tee "$OUT/fp8_$preset.txt" | tail -40
  done
fi
if stage fp8gemm; then
  python3 benchmarks/fp8_gemm_bench.py ${FP8GEMM_ARGS:-} --json "$OUT/fp8_gemm.json" 2>&1 | tee "$OUT/fp8_gemm.txt" \
    | tail -30
fi
if stage moe; then
  python3 benchmarks/moe_bench.py ${MOE_ARGS:-} --json "$OUT/moe.json" 2>&1 | tee "$OUT/moe.txt" | tail -20
  python3 benchmarks/moe_bench.py ${MOE_ARGS:-} --fp8 "${MOE_FP8:-block}" --json "$OUT/moe_fp8.json" 2>&1 \
    | tee "$OUT/moe_fp8.txt" | tail -20
fi
if stage profile; then
  python3 benchmarks/step_profile.py --no-progress ${PROFILE_ARGS:-} --out "$OUT/profile" 2>&1 | tee "$OUT/profile.txt" \
    | tail -120
fi
if stage ab; then
  python3 benchmarks/kernel_ab.py --rev "${AB_REV:?ab: set AB_REV, the commit whose kernels are the old side}" \
    --out "$OUT/kernel_ab" 2>&1 | tail -20
fi
if stage launch; then
  python3 benchmarks/launch_probe.py --no-progress ${LAUNCH_ARGS:---batches 40,256 --variants base,ssu.warps=2+attn.block_n=64} \
    --json "$OUT/launch_probe.json" 2>&1 | tail -24 | tee "$OUT/launch_probe.txt"
fi
if stage gemv; then
  python3 benchmarks/gemv_bench.py --no-progress ${GEMV_ARGS:-} --json "$OUT/gemv.json" 2>&1 | tee "$OUT/gemv.txt" | tail -48
fi
if stage fused; then
  python3 benchmarks/engine_bench.py --device cuda --no-progress --fused-gemv-max-tokens "${FUSED_MAX:-32}" \
    --batches 1,32 --prefill-splits 1 --reps 1 --out "$OUT/engine_fused" 2>&1 | tail -12
  python3 benchmarks/step_profile.py --no-progress --fused-gemv-max-tokens "${FUSED_MAX:-32}" --batches 1,32 \
    --out "$OUT/profile_fused" 2>&1 | tee "$OUT/profile_fused.txt" | tail -50
fi
if stage pdl; then
  for f in 0 "${FUSED_MAX:-1}"; do
    for p in 0 1; do
      echo "-- --fused-gemv-max-tokens $f, BATON_PDL=$p"
      BATON_PDL=$p python3 benchmarks/engine_bench.py --device cuda --no-progress --fused-gemv-max-tokens "$f" \
        --batches 1,32 --prefill-splits 1 --reps 1 --out "$OUT/engine_f${f}_pdl$p" 2>&1 | grep -E "^\| *(1|32) |^Preset"
    done
  done
fi
if stage scan; then
  python3 benchmarks/scan_bench.py 2>&1 | tail -16 | tee "$OUT/scan.txt"
fi
if stage kernels; then
  python3 benchmarks/kernels_bench.py 2>&1 | tail -24 | tee "$OUT/kernels.txt"
fi
if stage gdn; then
  python3 benchmarks/gdn_bench.py ${GDN_ARGS:-} --json "$OUT/gdn.json" 2>&1 | tee "$OUT/gdn.txt" | tail -60
fi
if stage sampling; then
  python3 benchmarks/sampling_bench.py --no-progress ${SAMPLING_ARGS:-} --json "$OUT/sampling.json" 2>&1 \
    | tee "$OUT/sampling.txt" | tail -20
fi
if stage samplingcost; then
  python3 benchmarks/sampling_cost_bench.py --device cuda --no-progress ${SAMPLINGCOST_ARGS:-} \
    --out "$OUT/sampling_cost" 2>&1 | tee "$OUT/sampling_cost.txt" | tail -16
fi
if stage mtp; then
  python3 benchmarks/mtp_bench.py --device cuda --out /tmp/mtp-bench --seconds 120 --prompts 8 --max-tokens 64 \
    --k-max 4 --no-progress --json "$OUT/mtp.json" 2>&1 | tee "$OUT/mtp.txt" | tail -32
fi
if stage spec; then
  # Verify steps against decode steps on SPEC_PRESET, at the acceptance lengths the mtp stage measured
  # (SPEC_ARGS, e.g. "--acceptance 1.6,1.8,1.9,1.9" without the mtp stage).
  acc=${SPEC_ARGS:-$([ -f "$OUT/mtp.json" ] && echo "--acceptance-json $OUT/mtp.json")}
  python3 benchmarks/spec_bench.py --device cuda --no-progress --preset "${SPEC_PRESET:-8b-like}" $acc \
    --out "$OUT/spec" 2>&1 | tee "$OUT/spec.txt" | tail -24
fi
if stage transfer; then
  if [ "$gpus" -ge 2 ]; then
    # NIXL's progress thread: the default 1 ms sleep between passes, then spinning (NIXL's own 0), both paths.
    for d in ${PROGRESS_DELAYS:-1000 0}; do
      for way in "" "--read-order one-read" --cuda-ipc; do
        echo "-- --nixl-progress-delay-us $d $way"
        python3 benchmarks/transfer_bench.py --device cuda --layouts contiguous,served,served-lowest,scattered --reps 20 $way \
          --nixl-progress-delay-us "$d" 2>&1 | grep -v "NIXL INFO" | tee -a "$OUT/transfer_cuda.txt" | tail -9
      done
    done
  fi
  python3 benchmarks/transfer_bench.py --device cpu --reps 3 2>&1 | grep -v "NIXL INFO" | tail -9 | tee "$OUT/transfer_cpu.txt"
fi
if stage serving; then
  preset=${SERVING_PRESET:-8b-like}
  # The 8b-like model's fp32 SSM state is 96 MiB per request: a 32 GiB pool holds 128 requests' state + KV.
  python3 benchmarks/serving_bench.py --out "$OUT/serving_$preset" --model-preset "$preset" \
    --model-dir "${MODEL_DIR:-.bench-model/$preset}" --log-dir /tmp/serving-logs --rates "${RATES:-auto}" --no-progress \
    ${SERVING_ARGS:---prompt-min 1024 --prompt-max 4096 --output-min 128 --output-max 512 --slo-tpot-ms 50} \
    --engine-args "${ENGINE_ARGS:---device cuda --dtype bfloat16 --max-num-seqs 128 --max-num-batched-tokens 2048 --cache-memory-mb 32768 --max-model-len 16384}" \
    ${PREFILL_ARGS:+--prefill-engine-args "$PREFILL_ARGS"} ${DECODE_ARGS:+--disagg-decode-engine-args "$DECODE_ARGS"} \
    2>&1 | tail -60
  # Logs stay on the machine (the device tool brings back 8 files at most: the JSONs come first); their tails:
  for f in /tmp/serving-logs/*/*.log; do echo "-- $f"; grep -v "NIXL INFO" "$f" | tail -5; done
fi
if stage multiturn; then
  python3 benchmarks/multiturn_bench.py --gpu --no-progress ${MULTITURN_ARGS:-} --out "$OUT/multiturn" \
    --log-dir /tmp/multiturn-logs 2>&1 | tail -40
  for f in /tmp/multiturn-logs/*.log /tmp/multiturn-logs/*/*.log; do [ -e "$f" ] && { echo "-- $f"; grep -v "NIXL INFO" "$f" | tail -3; }; done
  # Where each node's time went: steps (count, seconds), the decode side's READs (seconds), the prefix cache's hits
  # and evictions (checkpoint slots short?); the router's TTFT and its phases (Prefill call to handle, Decode call to
  # first token).
  for f in /tmp/multiturn-logs/*/*.metrics; do
    [ -e "$f" ] && echo "  $(basename "$(dirname "$f")")/$(basename "$f" .metrics): $(grep -hE \
      '^baton_node_step_duration_seconds_(sum|count)|^baton_node_transfer_seconds_total|^baton_node_step_device_seconds_total|^baton_node_prefix_(queried_tokens|hit_tokens|evictions)_total|^baton_router_(time_to_first_token|prefill|decode_first_token)_seconds_(sum|count)' \
      "$f" | sed -E 's/^baton_(node|router)_//' | tr '\n' ' ')"
  done
  # Kernel specializations each node met after its warm-up (a compile inside some request's step), by kernel.
  for f in /tmp/multiturn-logs/*.log /tmp/multiturn-logs/*/*.log; do
    [ -e "$f" ] && grep -h "first met after the warm-up" "$f" | sed -E 's/.*warm-up[^:]*: //' | cut -c1-400 \
      | sort | uniq -c | sort -rn | head -12 | sed "s|^|  $(basename "$(dirname "$f")")/$(basename "$f"): |"
  done
fi
if stage variants; then
  # VARIANTS_ENGINE_ARGS: the engine's flags (default: the multiturn stage's GPU nodes')
  python3 benchmarks/kernel_variants.py --device cuda --out "$OUT" ${VARIANTS_ARGS:-} --engine-args \
    "${VARIANTS_ENGINE_ARGS:---dtype bfloat16 --max-num-seqs 64 --max-num-batched-tokens 4096 --cache-memory-mb 16384}" \
    2>&1 | grep -v "it/s\]" | tail -40
fi
if stage ncu; then
  ncu --kernel-name "regex:${NCU_KERNELS:?ncu: set NCU_KERNELS}" --launch-count "${NCU_COUNT:-3}" --section SpeedOfLight \
    --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
    --section MemoryWorkloadAnalysis --page details python3 ${NCU_CMD:?ncu: set NCU_CMD} > "$OUT/ncu.txt" 2>&1
  grep -iE "^  [A-Za-z_]+.*\(|Duration|Throughput|Registers|Achieved Occupancy|Theoretical Occupancy|Block Limit|Warp Cycles Per Issued|stall|Eligible|Issued Warp|Shared Memory Configuration Size|Dynamic Shared|Static Shared|L1/TEX Hit|L2 Hit|Mem Busy|Max Bandwidth" \
    "$OUT/ncu.txt" | cut -c1-150 | head -150
fi
if stage commits; then
  # The tree against REV_A, the same machine and run: greedy_tokens.py's tokens on every step path (small preset
  # with an MTP layer: the Triton kernels, CUDA graphs, verify steps, the disaggregated copy), then engine_bench.py's
  # step times, A then B (COMMITS_BENCH_ARGS).
  # REV_A: a commit the copy's git knows, or with REV_A_TAR its tree (`git archive REV_A > FILE`, carried): the
  # device's copy of the repository may lag behind the tree.
  rev=${REV_A:?commits: set REV_A, the commit to compare the tree with}
  if [ -n "${REV_A_TAR:-}" ]; then
    mkdir -p /tmp/rev-a && tar -xf "$REV_A_TAR" -C /tmp/rev-a || exit 1
  else
    git worktree add -f --detach /tmp/rev-a "$rev" >/dev/null || exit 1
  fi
  python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/site-a /tmp/rev-a || exit 1
  python3 -m baton.cli.main make-model /tmp/gt-model --preset small --mtp-layers 1 --seed 0 --device cuda >/dev/null
  BATON_COMMIT=$rev PYTHONPATH=/tmp/site-a:/tmp/site python3 benchmarks/greedy_tokens.py --model /tmp/gt-model --device cuda \
    --out "$OUT/greedy_a.json" | tail -6
  python3 benchmarks/greedy_tokens.py --model /tmp/gt-model --device cuda --out "$OUT/greedy_b.json" | tail -6
  python3 benchmarks/greedy_tokens.py --compare "$OUT/greedy_a.json" "$OUT/greedy_b.json" | tee "$OUT/greedy_ab.txt"
  for side in a b; do
    echo "-- engine_bench, side $side"
    if [ $side = a ]; then dir=/tmp/rev-a; path=/tmp/site-a:/tmp/site; c=$rev; else dir=.; path=/tmp/site; c=${BATON_COMMIT:-}; fi
    (cd $dir && PYTHONPATH=$path BATON_COMMIT=$c python3 benchmarks/engine_bench.py --device cuda --no-progress \
      ${COMMITS_BENCH_ARGS:---prefill-splits 1,4} --out "$OUT/engine_$side" 2>&1 | tail -30)
  done
fi
