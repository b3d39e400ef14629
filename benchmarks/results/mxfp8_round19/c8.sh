# round 19 call (c8), H200 only (60 bf16 layers need more than an H100's 80 GB): the issue's 60-layer steps, MXFP8
# first (decode 1 against the <= 60 us target), then bf16; uniform routing, context 3000, 10 timed steps
. .probe/setup.sh
for q in mxfp8 bf16; do
  flag=""; [ "$q" = mxfp8 ] && flag="--quantization mxfp8"
  GRAPHCAP_CACHE_DIR=/tmp/ch_main PYTHONPATH=/tmp/site:$PWD timeout 230 python3 benchmarks/bench_steps.py --label $q \
    --routing uniform $flag --decode 1,8,32,64 --iters 10 --top-kernels 14 \
    --json $OUT/i_steps_$q.json > $OUT/i_steps_$q.log 2>&1; echo "$q rc=$?"
  grep -E "built|decode|mixed" $OUT/i_steps_$q.log | grep -v "chose\|eager GPU\|spread\|largest" | cut -c1-330
done
