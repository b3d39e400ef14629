# call 1 (round 18): 60-layer MXFP8 steps, main (.baseline/) vs this tree (the weight-row MoE's combine in its
# down kernel offered to the tuner), this tree's bench_steps for both (span split by kernel where the tree has
# it); then the GPU tests of the weight-row MoE
. .probe/setup.sh
for L in base:.baseline new:. ; do D=${L#*:}; L=${L%%:*}
  GRAPHCAP_CACHE_DIR=/tmp/ch_$L PYTHONPATH=/tmp/site:$PWD/$D timeout 200 python3 benchmarks/bench_steps.py --label $L \
    --routing uniform --quantization mxfp8 --decode 1,2,4,8,32,64 --iters 10 --top-kernels 14 \
    --json $OUT/a_steps_$L.json > $OUT/a_steps_$L.log 2>&1; echo "$L rc=$?"
  grep -E "decode|mixed" $OUT/a_steps_$L.log | grep -v "eager GPU\|spread" | grep -v "chose mxfp8" | cut -c1-400
done
PYTHONPATH=/tmp/site:$PWD timeout 150 python3 -m pytest -q -rs --timeout 140 tests/model/test_m3_moe_kernels.py \
  -k "gemv" > $OUT/a_tests_gemv.log 2>&1; echo "tests rc=$?"; tail -3 $OUT/a_tests_gemv.log
