# call 4 (round 18): on an H200 the table (scripts/gpu_suite.sh mxfp8 mxserve: 60-layer steps and serving,
# bf16 then MXFP8); on an H100 (60 bf16 layers do not fit): 60-layer MXFP8 decode 1 / 2, main vs the weight-row
# gate/up walking the experts (.probe/walk, gemv_walk.diff), then the MXFP8 steps in a deployment-wide block
# table (131072 tokens) and the MXFP8 and model GPU tests
. .probe/setup.sh
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "$mem" -gt 120000 ]; then
  PART_TIMEOUT_MXFP8=240 PART_TIMEOUT_MXSERVE=300 MXFP8_ARGS="--top-kernels 14" bash scripts/gpu_suite.sh mxfp8 mxserve > /dev/null 2>&1
  echo "suite rc=$?"
  grep -E "decode|mixed|spread" $OUT/suite.log | grep -v "chose\|eager GPU\|largest\|span by" | cut -c1-300
  grep -E "per-user|TTFT|vs full" $OUT/suite.log | cut -c1-200 | tail -12
  exit 0
fi
for L in main:. walk:.probe/walk; do D=${L#*:}; L=${L%%:*}
  GRAPHCAP_CACHE_DIR=/tmp/ch_$L PYTHONPATH=/tmp/site:$PWD/$D timeout 120 python3 benchmarks/bench_steps.py --label $L \
    --routing uniform --quantization mxfp8 --decode 1,2 --iters 10 --top-kernels 14 \
    --json $OUT/d_steps_$L.json > $OUT/d_steps_$L.log 2>&1; echo "$L rc=$?"
  grep -E "decode" $OUT/d_steps_$L.log | grep -v "chose\|eager GPU\|spread\|largest" | cut -c1-600
  grep -E "chose moe (1|2):" $OUT/d_steps_$L.log | grep -o "config[0-9]*\|gemv_block_n=[0-9]*\|gemv_combine=[A-Za-z]*\|gemv_walk=[A-Za-z]*" | tr '\n' ' '; echo
done
GRAPHCAP_CACHE_DIR=/tmp/ch_main PYTHONPATH=/tmp/site:$PWD timeout 150 python3 benchmarks/bench_steps.py --label wide \
  --routing uniform --quantization mxfp8 --decode 1,8,32,64 --iters 10 --top-kernels 14 --max-seq-len 131072 \
  --json $OUT/d_steps_wide.json > $OUT/d_steps_wide.log 2>&1; echo "wide rc=$?"
grep -E "decode|mixed" $OUT/d_steps_wide.log | grep -v "chose\|eager GPU\|spread\|largest" | cut -c1-400
(cd .probe/walk && PYTHONPATH=/tmp/site:$PWD timeout 100 python3 -m pytest -q -rs --timeout 90 tests/model/test_m3_moe_kernels.py \
  -k gemv > $OUT/d_tests_walk.log 2>&1; echo "walk tests rc=$?"; tail -2 $OUT/d_tests_walk.log)
PYTHONPATH=/tmp/site:$PWD timeout 90 python3 -m pytest -q -rs --timeout 85 -m cuda tests/model/test_mxfp8.py \
  tests/model/test_m3_model.py > $OUT/d_tests_model.log 2>&1; echo "tests rc=$?"; tail -3 $OUT/d_tests_model.log
