# round 20 (c11), H200 only: the 60-layer MXFP8 steps of the table (decode 1/8/32/64, mixed 30+1024) on the
# tree with the shared expert's gate/up rows; uniform routing, context 3000
. .probe/setup.sh
GRAPHCAP_CACHE_DIR=/tmp/ch_main PYTHONPATH=/tmp/site:$PWD timeout 250 python3 benchmarks/bench_steps.py --label mxfp8 \
  --routing uniform --quantization mxfp8 --decode 1,8,32,64 --iters 10 --top-kernels 8 \
  --json $OUT/p_steps_mxfp8.json > $OUT/p_steps_mxfp8.log 2>&1; echo "mxfp8 rc=$?"
grep -E "built|decode|mixed" $OUT/p_steps_mxfp8.log | grep -v "chose\|eager GPU\|spread\|largest" | cut -c1-330
