# call 3 (round 18): on an H200 the table (scripts/gpu_suite.sh mxfp8 mxserve: 60-layer steps and serving,
# bf16 then MXFP8); on an H100 (60 bf16 layers do not fit) the MXFP8 steps in a deployment-wide block table
# (131072 tokens) and the MXFP8 and model GPU tests
. .probe/setup.sh
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "$mem" -gt 120000 ]; then
  PART_TIMEOUT_MXFP8=240 PART_TIMEOUT_MXSERVE=300 MXFP8_ARGS="--top-kernels 14" bash scripts/gpu_suite.sh mxfp8 mxserve > /dev/null 2>&1
  echo "suite rc=$?"
  grep -E "decode|mixed|spread" $OUT/suite.log | grep -v "chose\|eager GPU\|largest\|span by" | cut -c1-300
  grep -E "per-user|TTFT|vs full" $OUT/suite.log | cut -c1-200 | tail -12
else
  GRAPHCAP_CACHE_DIR=/tmp/ch_new PYTHONPATH=/tmp/site:$PWD timeout 200 python3 benchmarks/bench_steps.py --label wide \
    --routing uniform --quantization mxfp8 --decode 1,8,32,64 --iters 10 --top-kernels 14 --max-seq-len 131072 \
    --json $OUT/c_steps_wide.json > $OUT/c_steps_wide.log 2>&1; echo "wide rc=$?"
  grep -E "decode|mixed" $OUT/c_steps_wide.log | grep -v "chose\|eager GPU\|spread\|largest" | cut -c1-600
  PYTHONPATH=/tmp/site:$PWD timeout 240 python3 -m pytest -q -rs --timeout 200 -m cuda tests/model/test_mxfp8.py \
    tests/model/test_m3_model.py > $OUT/c_tests_model.log 2>&1; echo "tests rc=$?"; tail -4 $OUT/c_tests_model.log
fi
