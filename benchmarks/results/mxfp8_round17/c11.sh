# call 5 (round 17): decode indexer alone, the ranked merge (main) vs ranked + strided chunks for rows that fill less
# than half of the table (the merge reading each block's key where its chunk stored it); GPU tests of the new tree
. .probe/setup.sh
for L in ranked:.probe/ranked adaptive:.probe/both3; do D=${L#*:}; L=${L%%:*}
  PYTHONPATH=/tmp/site:$PWD/$D timeout 200 python3 $D/benchmarks/bench_index_decode.py --label $L-cap128k --kv bf16,fp8 \
    --requests 1,8,32,64 --contexts 3000,16384,32768,49152,65536 --capacity 131072 --json $OUT/e_index_cap128k_$L.json > $OUT/e_index_cap128k_$L.log 2>&1
  echo "== $L cap128k rc=$?"; grep "ctx" $OUT/e_index_cap128k_$L.log | cut -c1-62
  PYTHONPATH=/tmp/site:$PWD/$D timeout 60 python3 $D/benchmarks/bench_index_decode.py --label $L-tight --kv bf16 \
    --requests 1,8,32,64 --contexts 3000,16384 --json $OUT/e_index_tight_$L.json > $OUT/e_index_tight_$L.log 2>&1
  echo "== $L tight rc=$?"; grep "ctx" $OUT/e_index_tight_$L.log | cut -c1-62
done
(cd .probe/both3 && PYTHONPATH=/tmp/site:$PWD timeout 150 python3 -m pytest -q -rs --timeout 140 -m cuda tests/attn/test_triton_indexer.py \
    tests/attn/test_prefill_tiles.py tests/attn/test_triton_sparse.py > $OUT/e_tests_indexer.log 2>&1); echo "== tests"; tail -2 $OUT/e_tests_indexer.log
