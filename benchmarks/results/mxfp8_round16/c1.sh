# call 1: the indexer's ranked merge, kernels alone, before (.baseline) / after, then its GPU tests
. .probe/setup.sh
for L in base:.baseline new:.; do D=${L#*:}; L=${L%%:*}
  PYTHONPATH=/tmp/site:$PWD/$D timeout 150 python3 benchmarks/bench_index_decode.py --label $L-cap128k --kv bf16 \
    --requests 1,8,32,64 --contexts 3000,65536,131072 --capacity 131072 --json $OUT/index_cap128k_$L.json > $OUT/index_cap128k_$L.log 2>&1
  echo "== $L rc=$?"; grep "ctx" $OUT/index_cap128k_$L.log
  PYTHONPATH=/tmp/site:$PWD/$D timeout 60 python3 benchmarks/bench_index_decode.py --label $L-tight --kv bf16 \
    --requests 1,8,32,64 --contexts 3000 --json $OUT/index_tight_$L.json > $OUT/index_tight_$L.log 2>&1
  grep "ctx" $OUT/index_tight_$L.log
done
PYTHONPATH=/tmp/site:$PWD timeout 150 python3 benchmarks/bench_index_decode.py --label new-prefill --kv bf16 --requests 1 \
  --contexts 3000,65536,131072 --prefill --prefill-rank-pieces 32,64,128 --json $OUT/index_prefill_new.json > $OUT/index_prefill_new.log 2>&1
echo "== prefill rc=$?"; grep "prefill chunk" $OUT/index_prefill_new.log | cut -c1-300
PYTHONPATH=/tmp/site:$PWD timeout 200 python3 -m pytest -q -rs --timeout 150 -m cuda tests/attn/test_triton_indexer.py tests/attn/test_prefill_tiles.py > $OUT/tests_indexer.log 2>&1
tail -4 $OUT/tests_indexer.log
for L in base:.baseline new:.; do D=${L#*:}; L=${L%%:*}
  PYTHONPATH=/tmp/site:$PWD/$D timeout 90 python3 $D/benchmarks/bench_m3_router_norm.py --tokens 128,512,1054,2048 --no-compile --no-flashinfer --json $OUT/router_$L.json > $OUT/router_$L.log 2>&1
  echo "== router $L rc=$?"; grep -i "route" $OUT/router_$L.log | head -8
done
PYTHONPATH=/tmp/site:$PWD timeout 150 python3 -m pytest -q -rs --timeout 140 -m cuda tests/model/test_m3_router_norm_kernels.py > $OUT/tests_router.log 2>&1; tail -3 $OUT/tests_router.log
