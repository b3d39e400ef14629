# call 2 (round 18): where decode 1's idle GPU time falls (span by kernel, idle named by the kernel after it), this
# tree, PDL early (default) vs off, decode 1 / 2 / 4
. .probe/setup.sh
for P in early off; do
  GRAPHCAP_PDL=$P GRAPHCAP_CACHE_DIR=/tmp/ch_new PYTHONPATH=/tmp/site:$PWD timeout 150 python3 benchmarks/bench_steps.py \
    --label pdl-$P --routing uniform --quantization mxfp8 --decode 1,2,4 --iters 5 --top-kernels 24 \
    --json $OUT/b_steps_pdl_$P.json > $OUT/b_steps_pdl_$P.log 2>&1; echo "$P rc=$?"
  grep -E "decode" $OUT/b_steps_pdl_$P.log | grep -v "eager GPU\|spread\|chose\|largest" | cut -c1-1500
done
