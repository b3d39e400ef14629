# call 3 (round 18): (1) where decode 1's idle GPU time falls (span by kernel, idle named by the kernel after it),
# this tree, PDL early (default) vs off; (2) on an H200 the table (scripts/gpu_suite.sh mxfp8 mxserve:
# 60-layer steps and serving, bf16 then MXFP8); on an H100 (60 bf16 layers do not fit) the MXFP8 steps in a
# deployment-wide block table (131072 tokens) instead
. .probe/setup.sh
for P in early off; do
  GRAPHCAP_PDL=$P GRAPHCAP_CACHE_DIR=/tmp/ch_new PYTHONPATH=/tmp/site:$PWD timeout 120 python3 benchmarks/bench_steps.py \
    --label pdl-$P --routing uniform --quantization mxfp8 --decode 1,2 --iters 5 --top-kernels 24 \
    --json $OUT/c_steps_pdl_$P.json > $OUT/c_steps_pdl_$P.log 2>&1; echo "$P rc=$?"
  grep -E "decode" $OUT/c_steps_pdl_$P.log | grep -v "eager GPU\|spread\|chose\|largest" | cut -c1-1200
done
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "$mem" -gt 120000 ]; then
  PART_TIMEOUT_MXFP8=200 PART_TIMEOUT_MXSERVE=230 bash scripts/gpu_suite.sh mxfp8 mxserve > /dev/null 2>&1; echo "suite rc=$?"
  grep -E "decode|mixed|spread" $OUT/suite.log | grep -v "chose\|eager GPU\|largest\|span by" | cut -c1-300
  grep -E "per-user|TTFT|vs full" $OUT/suite.log | cut -c1-200 | tail -12
else
  GRAPHCAP_CACHE_DIR=/tmp/ch_new PYTHONPATH=/tmp/site:$PWD timeout 200 python3 benchmarks/bench_steps.py --label wide \
    --routing uniform --quantization mxfp8 --decode 1,8,32,64 --iters 10 --top-kernels 14 --max-seq-len 131072 \
    --json $OUT/c_steps_wide.json > $OUT/c_steps_wide.log 2>&1; echo "wide rc=$?"
  grep -E "decode|mixed" $OUT/c_steps_wide.log | grep -v "chose\|eager GPU\|spread\|largest" | cut -c1-330
fi
