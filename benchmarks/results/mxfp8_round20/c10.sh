# round 19 (c10): the gemv MoE kernels alone at T = 1 and 2, main (.probe/base) vs the shared expert's gate/up rows
# of their own (.probe/base + gemv_shared_rows.diff applied, here the tree the script runs in), then 60-layer MXFP8
# decode 1 of both trees
. .probe/setup.sh
C="gemv=1,gemv_block_n=8,gemv_block_k=256,gemv_num_warps=2,gemv_combine=1;gemv=1,gemv_block_n=16,gemv_block_k=512,gemv_num_warps=4,gemv_combine=1;gemv=1,gemv_block_n=4,gemv_block_k=512,gemv_num_warps=2,gemv_combine=1"
for L in base:.probe/base new:.; do D=${L#*:}; L=${L%%:*}
  for T in 1 2; do
    (cd $D && PYTHONPATH=/tmp/site:$PWD timeout 45 python3 benchmarks/bench_moe_configs.py --tokens $T --kernels --configs "$C" \
      --json $OUT/k_moe_${L}_T$T.json > $OUT/k_moe_${L}_T$T.log 2>&1)
    echo "$L T=$T: $(grep -o '"us": [0-9.]*\|_moe_gemv_gate_up_kernel": [0-9.]*\|rel_err": [0-9.e-]*' $OUT/k_moe_${L}_T$T.log | tr '\n' ' ')"
  done
done
for L in new:. base:.probe/base; do D=${L#*:}; L=${L%%:*}; TS=$([ $L = new ] && echo 200 || echo 110)
  GRAPHCAP_CACHE_DIR=/tmp/ch_$L PYTHONPATH=/tmp/site:$PWD/$D timeout $TS python3 benchmarks/bench_steps.py --label $L \
    --routing uniform --quantization mxfp8 --decode 1 --iters 10 --top-kernels 14 --chunk 128 --mixed-decodes 1 \
    --json $OUT/k_steps_$L.json > $OUT/k_steps_$L.log 2>&1; echo "$L rc=$?"
  grep -E "decode 1" $OUT/k_steps_$L.log | grep -v "chose\|eager GPU\|spread\|largest" | cut -c1-330
done
PYTHONPATH=/tmp/site:$PWD timeout 60 python3 -m pytest -q -rs --timeout 55 tests/model/test_m3_moe_kernels.py \
  -k "cuda" > $OUT/k_tests_new.log 2>&1; echo "new tests rc=$?"; tail -2 $OUT/k_tests_new.log
