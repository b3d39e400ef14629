# call 6 (not run: no device time left): apply indexer_ranked_merge.diff to main first (git apply), with main itself in .baseline/; the hybrid merge (ranked when a row's candidates fit RANK_PIECE): kernels alone before/after, tests
. .probe/setup.sh
for L in base:.baseline new:.; do D=${L#*:}; L=${L%%:*}
  PYTHONPATH=/tmp/site:$PWD/$D timeout 150 python3 benchmarks/bench_index_decode.py --label $L-cap128k --kv bf16 \
    --requests 1,8,32,64 --contexts 3000,65536,131072 --capacity 131072 --json $OUT/f_index_cap128k_$L.json > $OUT/f_index_cap128k_$L.log 2>&1
  echo "== $L rc=$?"; grep "ctx" $OUT/f_index_cap128k_$L.log | cut -c1-100
  PYTHONPATH=/tmp/site:$PWD/$D timeout 100 python3 benchmarks/bench_index_decode.py --label $L-prefill --kv bf16 --requests 1 \
    --contexts 3000,65536 --prefill --json $OUT/f_index_prefill_$L.json > $OUT/f_index_prefill_$L.log 2>&1
  grep "prefill chunk" $OUT/f_index_prefill_$L.log | cut -c1-200
done
PYTHONPATH=/tmp/site:$PWD timeout 150 python3 -m pytest -q -rs --timeout 140 -m cuda tests/attn/test_triton_indexer.py tests/attn/test_prefill_tiles.py > $OUT/f_tests_indexer.log 2>&1
tail -2 $OUT/f_tests_indexer.log
