# call 5 (round 18, c4.sh cut to the device time left): on an H200 the 60-layer MXFP8 steps (decode 1 / 8 /
# 32 / 64, mixed); on an H100: 60-layer MXFP8 decode 1 / 2, main vs the weight-row gate/up walking the experts
# (.probe/walk, gemv_walk.diff), and the walk tree's weight-row MoE GPU tests
. .probe/setup.sh
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "$mem" -gt 120000 ]; then
  GRAPHCAP_CACHE_DIR=/tmp/ch_main PYTHONPATH=/tmp/site:$PWD timeout 200 python3 benchmarks/bench_steps.py --label h200 \
    --routing uniform --quantization mxfp8 --decode 1,8,32,64 --iters 10 --top-kernels 14 \
    --json $OUT/e_steps_h200.json > $OUT/e_steps_h200.log 2>&1; echo "h200 rc=$?"
  grep -E "decode|mixed|spread" $OUT/e_steps_h200.log | grep -v "chose\|eager GPU\|largest" | cut -c1-500
  exit 0
fi
for L in main:. walk:.probe/walk; do D=${L#*:}; L=${L%%:*}
  GRAPHCAP_CACHE_DIR=/tmp/ch_$L PYTHONPATH=/tmp/site:$PWD/$D timeout 110 python3 benchmarks/bench_steps.py --label $L \
    --routing uniform --quantization mxfp8 --decode 1,2 --iters 10 --top-kernels 14 \
    --json $OUT/e_steps_$L.json > $OUT/e_steps_$L.log 2>&1; echo "$L rc=$?"
  grep -E "decode" $OUT/e_steps_$L.log | grep -v "chose\|eager GPU\|spread\|largest" | cut -c1-600
  grep -E "chose moe (1|2):" $OUT/e_steps_$L.log | grep -o "config[0-9]*\|gemv_block_n=[0-9]*\|gemv_combine=[A-Za-z]*\|gemv_walk=[A-Za-z]*" | tr '\n' ' '; echo
done
(cd .probe/walk && PYTHONPATH=/tmp/site:$PWD timeout 50 python3 -m pytest -q -rs --timeout 45 tests/model/test_m3_moe_kernels.py \
  -k "gemv and cuda" > $OUT/e_tests_walk.log 2>&1; echo "walk tests rc=$?"; tail -2 $OUT/e_tests_walk.log)
