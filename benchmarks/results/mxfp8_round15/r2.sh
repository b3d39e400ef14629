. .probe/setup.sh
STEPS_ARGS="--decode 1,8,32,64 --mixed-decodes 1 --chunk 16 --iters 10 --top-kernels 8" RUN_TIMEOUT=110 bash .probe/steps.sh base:.baseline new:. 2>&1 | grep -v "chose\|spread"
grep -h "largest" $OUT/steps_*.log | grep "decode 32\|decode 64" | cut -c1-400
( PYTHONPATH=/tmp/site:$PWD timeout 150 python3 -m pytest -q -rs --timeout 140 tests/model/test_m3_router_norm_kernels.py tests/model/test_mxfp8_linear_kernel.py tests/model/test_m3_moe_kernels.py -k "(router or route or bf16_split or candidates or diag or real_shapes_and_graph or every_candidate) and not compile" 2>&1 | tail -8 ) > $OUT/tests.log 2>&1; cat $OUT/tests.log
for L in base:.baseline new:.; do D=${L#*:}; L=${L%%:*}
  PYTHONPATH=/tmp/site:$PWD/$D timeout 60 python3 $D/benchmarks/bench_m3_router_norm.py --tokens 3,8,32,64,100 --no-compile --no-flashinfer --json $OUT/router_$L.json > $OUT/router_$L.log 2>&1
  echo "== router $L"; grep -i "route" $OUT/router_$L.log | head -12
done
PYTHONPATH=/tmp/site:$PWD timeout 90 python3 benchmarks/bench_mxfp8_linear.py --tokens 32,64 --json $OUT/linear_new.json > $OUT/linear_new.log 2>&1; tail -12 $OUT/linear_new.log
