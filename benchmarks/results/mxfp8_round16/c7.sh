# call 7 (not run: no device time left): apply indexer_strided_chunks.diff to main first (git apply), main itself in
# .baseline/; decode indexer alone in a deployment-wide (128K) table and a tight one, before/after, then its GPU tests
. .probe/setup.sh
for L in base:.baseline new:.; do D=${L#*:}; L=${L%%:*}
  for cap in 131072 0; do
    PYTHONPATH=/tmp/site:$PWD/$D timeout 150 python3 benchmarks/bench_index_decode.py --label $L-cap$cap --kv bf16,fp8 \
      --requests 1,8,32,64 --contexts 3000,16384,65536,131072 --capacity $cap --json $OUT/g_index_cap${cap}_$L.json > $OUT/g_index_cap${cap}_$L.log 2>&1
    echo "== $L cap $cap rc=$?"; grep "ctx" $OUT/g_index_cap${cap}_$L.log | cut -c1-100
  done
done
PYTHONPATH=/tmp/site:$PWD timeout 150 python3 -m pytest -q -rs --timeout 140 -m cuda tests/attn/test_triton_indexer.py tests/attn/test_prefill_tiles.py > $OUT/g_tests_indexer.log 2>&1
tail -2 $OUT/g_tests_indexer.log
