# call 6 (not run: no device time left): 60-layer MXFP8 steps in a deployment-wide block table (131072 tokens), the
# ranked merge alone (a57d61b, in .probe/ranked) vs main (its strided chunks for short rows), this checkout's
# bench_steps.py measuring both trees (PYTHONPATH picks the tree); then the tight table on main for reference
. .probe/setup.sh
for L in ranked:.probe/ranked main:. ; do D=${L#*:}; L=${L%%:*}
  GRAPHCAP_CACHE_DIR=/tmp/ch_$L PYTHONPATH=/tmp/site:$PWD/$D timeout 170 python3 benchmarks/bench_steps.py --label $L-wide \
    --routing uniform --quantization mxfp8 --decode 1,8,32,64 --iters 10 --top-kernels 12 --max-seq-len 131072 \
    --json $OUT/f_steps_wide_$L.json > $OUT/f_steps_wide_$L.log 2>&1; echo "$L rc=$?"
  grep -E "built|decode|mixed" $OUT/f_steps_wide_$L.log | grep -v "largest\|eager GPU" | cut -c1-250
done
