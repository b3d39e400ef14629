# call 5 (round 18, c4.sh cut to the device time left): on an H200 the 60-layer steps (scripts/gpu_suite.sh
# mxfp8: bf16 then MXFP8); on an H100 (60 bf16 layers do not fit): 60-layer MXFP8 decode 1 / 2, main vs the
# weight-row gate/up walking the experts (.probe/walk, gemv_walk.diff), and the MXFP8 and model GPU tests
. .probe/setup.sh
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "$mem" -gt 120000 ]; then
  PART_TIMEOUT_MXFP8=270 MXFP8_ARGS="--top-kernels 14" bash scripts/gpu_suite.sh mxfp8 > /dev/null 2>&1; echo "suite rc=$?"
  grep -E "decode|mixed|spread" $OUT/suite.log | grep -v "chose\|eager GPU\|largest\|span by" | cut -c1-300
  exit 0
fi
for L in main:. walk:.probe/walk; do D=${L#*:}; L=${L%%:*}
  GRAPHCAP_CACHE_DIR=/tmp/ch_$L PYTHONPATH=/tmp/site:$PWD/$D timeout 120 python3 benchmarks/bench_steps.py --label $L \
    --routing uniform --quantization mxfp8 --decode 1,2 --iters 10 --top-kernels 14 \
    --json $OUT/e_steps_$L.json > $OUT/e_steps_$L.log 2>&1; echo "$L rc=$?"
  grep -E "decode" $OUT/e_steps_$L.log | grep -v "chose\|eager GPU\|spread\|largest" | cut -c1-600
  grep -E "chose moe (1|2):" $OUT/e_steps_$L.log | grep -o "config[0-9]*\|gemv_block_n=[0-9]*\|gemv_combine=[A-Za-z]*\|gemv_walk=[A-Za-z]*" | tr '\n' ' '; echo
done
(cd .probe/walk && PYTHONPATH=/tmp/site:$PWD timeout 60 python3 -m pytest -q -rs --timeout 55 tests/model/test_m3_moe_kernels.py \
  -k "gemv and cuda" > $OUT/e_tests_walk.log 2>&1; echo "walk tests rc=$?"; tail -2 $OUT/e_tests_walk.log)
PYTHONPATH=/tmp/site:$PWD timeout 90 python3 -m pytest -q -rs --timeout 85 -m cuda tests/model/test_mxfp8.py \
  tests/model/test_m3_model.py > $OUT/e_tests_model.log 2>&1; echo "tests rc=$?"; tail -3 $OUT/e_tests_model.log
