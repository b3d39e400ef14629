#!/usr/bin/env bash
# The GPU suite: `cuda`-marked tests and the benchmarks, in one call, for the device machine.
# Writes suite.log and the JSON results under $OUT (default ./out).
#
#   scripts/gpu_suite.sh                      # tests, then every benchmark
#   scripts/gpu_suite.sh tests moe producers  # a subset, in the order given
#
# Parts: tests, toy, kernels (attention kernels), moe, routernorm, tiles, profile (16-layer
# rank-of-8 profile), producers (60-layer producer benchmark), startup (60-layer start-up: cold
# and warm start, phases, memory per bucket; STARTUP_BASELINE=1 adds a cold start that compiles
# Triton kernels on first launch, for the side-by-side), serve (60-layer serving simulation by capture mode),
# overlap (decode step wall vs GPU-busy through the engine), soak (10k-step serving soak with
# recaptures and checks), tp (tensor parallelism through NCCL: the parallel tests, then
# profile_forward under torchrun at real width, --tp 1 beside the same run without a group, and
# --tp <GPUs> when the machine has several), steps (60-layer decode 1/8/32 and mixed 30+1024, wall and
# GPU-busy; with a checkout of an earlier commit in .baseline/, the same benchmark on it first, side
# by side), audit (60-layer serving with audits off, 1 in 10 and 1 in 1000), routing (60-layer steps
# with the concentrated random router, the calibrated one and uniform routing), fp8linear (the
# MXFP8 projections: bf16 vs dequantise + F.linear vs the Triton fp8 kernels), fp8stream (how fast a
# plain kernel streams fp8 weights, row-major vs tiled, and with the MXFP8 inner loops' scales and
# dequantise), moeconfigs (given MoE tile sets, time per kernel), mxfp8 (60-layer steps,
# bf16 then MXFP8), mxserve (serving, bf16 then MXFP8, same requests), mxacc (MXFP8 vs its
# dequantised bf16 twin: logits and 200-step greedy agreement), longserve (the long-context serving
# preset), ttft (one 128K prompt alone), fp8decode (decode 32 at 128K, bf16 vs fp8 KV), indexdecode (the
# decode step's sparse kernels alone at 64K and 128K, bf16 vs fp8 KV), pdl (steps with programmatic
# dependent launch off and in each mode), or a pytest path.
# flashinfer travels as files in .whl/ (see README, "GPU runs"); it is installed into /tmp/site
# when present. JIT and autotune caches stay on the machine between parts of one call.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
LOG="$OUT/suite.log"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 FLASHINFER_USE_CUDA_NORM=1
if ls .whl/apache_tvm_ffi-*.whl >/dev/null 2>&1 && [ -f .whl/flashinfer-0.7.4-site.tar.xz ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/apache_tvm_ffi-*.whl \
    && tar -xJf .whl/flashinfer-0.7.4-site.tar.xz -C /tmp/site \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# The package itself: on the device there is no pip install -e, so the checkout goes on the path.
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests toy moe routernorm tiles profile producers)
status=0
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  python3 -c 'import flashinfer; print("flashinfer", flashinfer.__version__)' 2>&1 | tail -1
} 2>&1 | tee "$LOG"
# One Triton and flashinfer cache for every part (graphcap's default places), whatever
# GRAPHCAP_CACHE_DIR a part sets for its kernel choices.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$HOME/.cache/graphcap/triton}
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-$HOME/.cache/graphcap/flashinfer}
fresh_choices() {  # CHOICES: an empty graphcap cache directory (kernel choices only) for run $1
  CHOICES=/tmp/graphcap_choices_$1; rm -rf "$CHOICES"; mkdir -p "$CHOICES"
}
budget() {  # per-part time box in seconds: PART_TIMEOUT_<PART> or the default
  local v="PART_TIMEOUT_${1^^}"; v=${v//[^A-Z0-9_]/_}; echo "${!v:-${PART_TIMEOUT:-900}}"
}
for part in "${parts[@]}"; do
  echo "=== $part ($(date +%T)) ===" | tee -a "$LOG"
  T="timeout --signal=INT $(budget "$part")"
  case "$part" in
    tests)      # TEST_PATHS splits the GPU tests over calls (default: all of tests/)
                $T python3 -m pytest -m cuda -q -rs --timeout 300 ${TEST_PATHS:-tests/} 2>&1 | tee -a "$LOG"; rc=${PIPESTATUS[0]} ;;
    toy)        $T python3 benchmarks/bench_toy.py --json "$OUT/bench_toy.json" 2>&1 | tee -a "$LOG"; rc=${PIPESTATUS[0]} ;;
    kernels)    $T python3 benchmarks/bench_attention_kernels.py --out "$OUT/bench_attention.json" 2>&1 | tee -a "$LOG"; rc=${PIPESTATUS[0]} ;;
    moe)        $T python3 benchmarks/bench_m3_moe.py ${MOE_ARGS:-} --json "$OUT/bench_m3_moe.json" 2>&1 | tee -a "$LOG"; rc=${PIPESTATUS[0]} ;;
    routernorm) $T python3 benchmarks/bench_m3_router_norm.py --json "$OUT/bench_m3_router_norm.json" 2>&1 | tee -a "$LOG"; rc=${PIPESTATUS[0]} ;;
    tiles)      $T python3 benchmarks/bench_prefill_tiles.py ${TILES_ARGS:-} --json "$OUT/bench_prefill_tiles${TILES_TAG:-}.json" 2>&1 | tee -a "$LOG"; rc=${PIPESTATUS[0]} ;;
    profile)    $T python3 examples/profile_forward.py --preset rank-of-8 --layers 16 --decode 1,2,4,8,16,32 --context 3000 --json "$OUT/profile_rank_of_8.json" 2>&1 | tee -a "$LOG"; rc=${PIPESTATUS[0]} ;;
    startup)    # two starts on one cache directory: cold (empty), then warm (what the first wrote)
                # STARTUP_BASELINE=1: first a cold start that compiles each Triton kernel on its first
                # launch (--compile-workers 0), on a cache directory of its own, for the side-by-side.
                if [ "${STARTUP_BASELINE:-0}" = 1 ]; then
                  rm -rf /tmp/graphcap-cache-serial
                  GRAPHCAP_CACHE_DIR=/tmp/graphcap-cache-serial $T python3 benchmarks/bench_startup.py --compile-workers 0 --profile-bucket 0 --iters 5 --json "$OUT/bench_startup_cold_serial.json" 2>&1 | tee -a "$LOG"
                fi
                export GRAPHCAP_CACHE_DIR=${GRAPHCAP_CACHE_DIR:-/tmp/graphcap-cache}; rm -rf "$GRAPHCAP_CACHE_DIR"
                $T python3 benchmarks/bench_startup.py --frozen --json "$OUT/bench_startup_cold.json" 2>&1 | tee -a "$LOG"; rc=${PIPESTATUS[0]}
                if [ "$rc" -eq 0 ]; then
                  $T python3 benchmarks/bench_startup.py --profile-bucket 0 ${STARTUP_PROFILE:+--profile-start} --json "$OUT/bench_startup_warm.json" 2>&1 | tee -a "$LOG"; rc=${PIPESTATUS[0]}
                fi ;;
    serve)      $T python3 examples/serve_sim.py --preset rank-of-8 --modes ${SERVE_MODES:-decode,full_and_piecewise,none} --json "$OUT/serve_sim_rank_of_8.json" --plot "$OUT/serve_sim_rank_of_8.png" --trace "$OUT/serve_sim_trace.json" 2>&1 | tee -a "$LOG"; rc=${PIPESTATUS[0]} ;;
    overlap)    $T python3 benchmarks/bench_serving_overlap.py --json "$OUT/bench_serving_overlap.json" 2>&1 | tee -a "$LOG"; rc=${PIPESTATUS[0]} ;;
    soak)       $T python3 benchmarks/soak_serving.py --steps ${SOAK_STEPS:-10000} --json "$OUT/soak_serving.json" 2>&1 | tee -a "$LOG"; rc=${PIPESTATUS[0]} ;;
    tp)         NGPU=$(nvidia-smi -L | wc -l); L=${TP_LAYERS:-4}
                PF="examples/profile_forward.py --preset real --layers $L --decode 1,8,32 --context 1000 --iters 20"
                rc=0
                if [ "${TP_TESTS:-1}" = 1 ]; then  # TP_TESTS=0: the profiles only (the tests part ran them)
                  $T python3 -m pytest -q -rs --timeout 400 tests/parallel 2>&1 | tee -a "$LOG"; rc=${PIPESTATUS[0]}
                fi
                $T python3 $PF --json "$OUT/profile_real${L}_nogroup.json" 2>&1 | tee -a "$LOG"; rc=$((rc | PIPESTATUS[0]))
                $T python3 -m torch.distributed.run --nproc-per-node 1 $PF --tp 1 --json "$OUT/profile_real${L}_tp1.json" 2>&1 | tee -a "$LOG"; rc=$((rc | PIPESTATUS[0]))
                if [ "$NGPU" -ge 2 ]; then
                  $T python3 -m torch.distributed.run --nproc-per-node "$NGPU" $PF --tp "$NGPU" --json "$OUT/profile_real${L}_tp${NGPU}.json" 2>&1 | tee -a "$LOG"; rc=$((rc | PIPESTATUS[0]))
                  $T python3 -m torch.distributed.run --nproc-per-node "$NGPU" examples/serve_sim.py --preset real --layers $L --tp "$NGPU" --modes decode,full_and_piecewise --requests 24 --concurrency 16 --prompt-len 200:800 --output-len 32:64 --chunk 512 --json "$OUT/serve_sim_real${L}_tp${NGPU}.json" 2>&1 | tee -a "$LOG"; rc=$((rc | PIPESTATUS[0]))
                fi ;;
    producers)  $T python3 benchmarks/bench_m3_producers.py --json "$OUT/bench_m3_producers.json" 2>&1 | tee -a "$LOG"; rc=${PIPESTATUS[0]} ;;
    steps)      # Each run tunes its own kernel choices (an empty choice file of its own; the compiled
                # kernels stay shared): a run that read the other's stored choices would time
                # the other checkout's tuner, not its own.
                rc=0
                if [ -d .baseline ]; then  # the earlier checkout's packages first on the path, not this one's
                  fresh_choices before
                  PYTHONPATH=$PWD/.baseline:${PYTHONPATH#"$PWD":} GRAPHCAP_CACHE_DIR=$CHOICES $T python3 benchmarks/bench_steps.py --label before ${STEPS_ARGS:-} --json "$OUT/bench_steps_before.json" 2>&1 | tee -a "$LOG"; rc=${PIPESTATUS[0]}
                fi
                fresh_choices after
                GRAPHCAP_CACHE_DIR=$CHOICES $T python3 benchmarks/bench_steps.py --label after ${STEPS_ARGS:-} --json "$OUT/bench_steps_after${STEPS_TAG:-}.json" 2>&1 | tee -a "$LOG"; rc=$((rc | PIPESTATUS[0])) ;;
    routing)    # 60-layer steps under three routings, side by side: the uncalibrated random router
                # (concentrated: earlier figures), the calibrated router, the uniform simulation
                rc=0
                for r in ${ROUTING_KINDS:-concentrated model uniform}; do
                  flag="--routing $r"; [ "$r" = concentrated ] && flag="--concentrated"
                  $T python3 benchmarks/bench_steps.py $flag --label "$r" --decode ${ROUTING_DECODE:-1,8,32,64} --json "$OUT/bench_steps_routing_$r.json" 2>&1 | tee -a "$LOG"; rc=$((rc | PIPESTATUS[0]))
                done ;;
    fp8stream)  $T python3 benchmarks/bench_fp8_stream.py --json "$OUT/bench_fp8_stream.json" 2>&1 | tee -a "$LOG"; rc=${PIPESTATUS[0]} ;;
    moeconfigs) # MOE_CONFIGS_T tokens, MOE_CONFIGS the ';'-joined configs (benchmarks/bench_moe_configs.py)
                $T python3 benchmarks/bench_moe_configs.py --tokens ${MOE_CONFIGS_T:-1054} --configs "${MOE_CONFIGS:-default}" --kernels --json "$OUT/bench_moe_configs.json" 2>&1 | tee -a "$LOG"; rc=${PIPESTATUS[0]} ;;
    fp8linear)  $T python3 benchmarks/bench_mxfp8_linear.py --json "$OUT/bench_mxfp8_linear.json" 2>&1 | tee -a "$LOG"; rc=${PIPESTATUS[0]} ;;
    mxfp8)      # 60-layer steps, bf16 then MXFP8 (the same preset quantized), uniform routing by default;
                # MXFP8_ARGS adds flags to both runs (e.g. --layers 30 where 60 bf16 layers do not fit)
                rc=0
                for q in bf16 mxfp8; do
                  flag=""; [ "$q" = mxfp8 ] && flag="--quantization mxfp8"
                  $T python3 benchmarks/bench_steps.py --routing ${MXFP8_ROUTING:-uniform} $flag --label "$q" --decode ${MXFP8_DECODE:-1,8,32,64} --iters ${MXFP8_ITERS:-10} ${MXFP8_ARGS:-} --json "$OUT/bench_steps_$q.json" 2>&1 | tee -a "$LOG"; rc=$((rc | PIPESTATUS[0]))
                done ;;
    mxserve)    # serving, bf16 then MXFP8, the same requests (c30 default workload, calibrated routing);
                # MXSERVE_ARGS adds flags (e.g. --layers 30 where 60 bf16 layers do not fit)
                $T python3 examples/serve_sim.py --preset rank-of-8 --weights bf16,mxfp8 --modes ${SERVE_MODES:-full_and_piecewise} ${MXSERVE_ARGS:-} --json "$OUT/serve_sim_mxfp8.json" 2>&1 | tee -a "$LOG"; rc=${PIPESTATUS[0]} ;;
    mxacc)      $T python3 benchmarks/mxfp8_accuracy.py --layers ${MXACC_LAYERS:-20} --steps 200 --json "$OUT/mxfp8_accuracy.json" 2>&1 | tee -a "$LOG"; rc=${PIPESTATUS[0]} ;;
    longserve)  # the long-context serving preset (c8, prompts 32K-128K; decode vs full_and_piecewise, bf16 vs fp8 KV)
                $T python3 examples/serve_sim.py --preset rank-of-8 --workload long ${LONGSERVE_ARGS:-} --json "$OUT/serve_sim_long${LONGSERVE_TAG:-}.json" 2>&1 | tee -a "$LOG"; rc=${PIPESTATUS[0]} ;;
    ttft)       # one 128K prompt alone: prefill to first token, with its chunk steps (TTFT_ARGS: e.g. --kv-dtype fp8)
                $T python3 examples/serve_sim.py --preset rank-of-8 --workload long --requests 1 --concurrency 1 --prompt-len ${TTFT_LEN:-128000} --output-len 2 --modes full_and_piecewise --kv-dtype bf16 ${TTFT_ARGS:-} --json "$OUT/serve_sim_ttft.json" 2>&1 | tee -a "$LOG"; rc=${PIPESTATUS[0]} ;;
    indexdecode) # the decode step's sparse kernels at 64K and 128K, bf16 vs fp8 KV (with a checkout of an earlier
                # commit in .baseline/, the same benchmark on it first, side by side); INDEXDECODE_ARGS e.g. --prefill
                rc=0
                if [ -d .baseline ]; then
                  PYTHONPATH=$PWD/.baseline:${PYTHONPATH#"$PWD":} $T python3 benchmarks/bench_index_decode.py --label before --json "$OUT/bench_index_decode_before.json" 2>&1 | tee -a "$LOG"; rc=${PIPESTATUS[0]}
                fi
                $T python3 benchmarks/bench_index_decode.py --label after ${INDEXDECODE_ARGS:-} --json "$OUT/bench_index_decode${INDEXDECODE_TAG:-}.json" 2>&1 | tee -a "$LOG"; rc=$((rc | PIPESTATUS[0])) ;;
    fp8decode)  # decode at long context, bf16 vs fp8 KV: the sparse kernels' GPU time per layer (FP8DECODE_LAYERS
                # layers so 32 requests of 128K fit; the per-layer kernels do not depend on the layer count).
                # Summed kernel times: PDL off (a PDL-launched kernel's time includes its wait for the one before)
                rc=0
                for kv in bf16 fp8; do
                  GRAPHCAP_PDL=${GRAPHCAP_PDL:-off} $T python3 benchmarks/bench_steps.py --layers ${FP8DECODE_LAYERS:-8} --context ${FP8DECODE_CTX:-128000} --decode 32 --mixed-decodes 3 --requests 32 --iters 10 --kv-dtype $kv --label "kv-$kv" --json "$OUT/bench_steps_kv_$kv.json" 2>&1 | tee -a "$LOG"; rc=$((rc | PIPESTATUS[0]))
                done ;;
    pdl)        # steps with programmatic dependent launch off, then each mode (attention/kernels/pdl.py), one
                # tree; PDL_ARGS: bench_steps flags (default: 30 layers of MXFP8, uniform routing, decode 1 and 32)
                rc=0
                for m in ${PDL_MODES:-off wait early}; do
                  fresh_choices "pdl_$m"
                  GRAPHCAP_PDL=$m GRAPHCAP_CACHE_DIR=$CHOICES $T python3 benchmarks/bench_steps.py --label "pdl-$m" ${PDL_ARGS:---layers 30 --quantization mxfp8 --routing uniform --decode 1,32 --iters 10} --json "$OUT/bench_steps_pdl_$m.json" 2>&1 | tee -a "$LOG"; rc=$((rc | PIPESTATUS[0]))
                done ;;
    audit)      $T python3 examples/serve_sim.py --preset rank-of-8 --modes full_and_piecewise --audit-every ${AUDIT_EVERY:-0,10,1000} --json "$OUT/serve_sim_audit.json" 2>&1 | tee -a "$LOG"; rc=${PIPESTATUS[0]} ;;
    *)          $T python3 -m pytest -q -rs --timeout 300 "$part" 2>&1 | tee -a "$LOG"; rc=${PIPESTATUS[0]} ;;
  esac
  echo "=== $part exit $rc ===" | tee -a "$LOG"
  [ "$rc" -ne 0 ] && status=1
done
exit $status
