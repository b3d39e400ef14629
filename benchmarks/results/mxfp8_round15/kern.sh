# call 1: pending GPU tests, then MoE configs alone at T=1/32/64
. .probe/setup.sh
export PYTHONPATH=/tmp/site:$PWD
( timeout ${TEST_TIMEOUT:-170} python3 -m pytest -m cuda -q -rs --timeout 160 tests/model/test_m3_moe_kernels.py \
   -k "diag or f16_epilogue_activation or fp8_mma_replay" 2>&1 | tail -15 ) > $OUT/tests.log 2>&1; cat $OUT/tests.log
DIAG8="fp8_mma=1,mma_diag=1,mma_block_t=8,mma_num_stages=3"
for T in 32 64 1; do
  if [ $T = 1 ]; then C="gemv=1,gemv_block_n=16,gemv_num_warps=4;fp8_mma=1,mma_split=4;$DIAG8,mma_split=4;$DIAG8,mma_split=2"
  else C="fp8_f16=1;fp8_mma=1;fp8_mma=1,mma_split=2;$DIAG8;$DIAG8,mma_split=2;fp8_mma=1,mma_diag=1,mma_block_t=16"; fi
  timeout ${K_TIMEOUT:-120} python3 benchmarks/bench_moe_configs.py --tokens $T --configs "$C" --kernels --json $OUT/moe_t$T.json > $OUT/moe_t$T.log 2>&1
  grep -v "^ *_moe\|^$" $OUT/moe_t$T.log | tail -12
done
