# call 2: 60-layer MXFP8 steps, trees given as label:dir
. .probe/setup.sh
for spec in "$@"; do
  L=${spec%%:*}; D=${spec#*:}; rm -rf /tmp/ch_$L
  GRAPHCAP_CACHE_DIR=/tmp/ch_$L PYTHONPATH=/tmp/site:$PWD/$D timeout ${RUN_TIMEOUT:-280} python3 $D/benchmarks/bench_steps.py --label $L \
    --routing uniform --quantization mxfp8 ${STEPS_ARGS:---decode 1,8,32,64 --mixed-decodes 1 --chunk 16 --iters 10} \
    --json $OUT/steps_$L.json > $OUT/steps_$L.log 2>&1; echo "$L rc=$?"
  grep -E "built|chose moe (1|8|32|64):|decode|mixed" $OUT/steps_$L.log | grep -v "largest" | cut -c1-250
done
