# round 19 call (c6): on an H200, 60-layer MXFP8 decode 1 / 2, main then the gate/up walk tree (.probe/walk), the walk
# tree's weight-row MoE GPU tests, then the steps table (bf16 then MXFP8, main); on an H100, main vs walk at
# decode 1 / 2, the walk tests, then MXFP8 steps in a 131072-token block table
. .probe/setup.sh
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
steps() {  # label tree timeout decode [extra]
  GRAPHCAP_CACHE_DIR=/tmp/ch_$1 PYTHONPATH=/tmp/site:$PWD/$2 timeout $3 python3 benchmarks/bench_steps.py --label $1 \
    --routing uniform --quantization mxfp8 --decode $4 --iters 10 --top-kernels 14 $5 \
    --json $OUT/f_steps_$1.json > $OUT/f_steps_$1.log 2>&1; echo "$1 rc=$?"
  grep -E "decode|mixed" $OUT/f_steps_$1.log | grep -v "chose\|eager GPU\|spread\|largest\|span by" | cut -c1-400
  grep -E "chose moe (1|2):" $OUT/f_steps_$1.log | grep -o "config[0-9]*\|gemv_block_n=[0-9]*\|gemv_combine=[A-Za-z]*\|gemv_walk=[A-Za-z]*" | tr '\n' ' '; echo
}
walktests() {
  (cd .probe/walk && PYTHONPATH=/tmp/site:$PWD timeout 60 python3 -m pytest -q -rs --timeout 55 tests/model/test_m3_moe_kernels.py \
    -k "gemv and cuda" > $OUT/f_tests_walk.log 2>&1; echo "walk tests rc=$?"; tail -2 $OUT/f_tests_walk.log)
}
if [ "$mem" -gt 120000 ]; then
  steps main . 110 1,2
  steps walk .probe/walk 110 1,2
  walktests
  PART_TIMEOUT_MXFP8=250 MXFP8_DECODE=1,2,8,32,64 MXFP8_ARGS="--top-kernels 14" bash scripts/gpu_suite.sh mxfp8 > /dev/null 2>&1
  echo "suite rc=$?"
  grep -E "decode|mixed|spread|weights" $OUT/suite.log | grep -v "chose\|eager GPU\|largest\|span by" | cut -c1-300
  exit 0
fi
steps main . 110 1,2
steps walk .probe/walk 110 1,2
walktests
steps wide . 150 1,8,32,64 "--max-seq-len 131072"
