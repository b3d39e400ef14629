# call 1 (round 17): decode indexer alone, main vs hybrid ranked merge vs strided chunks, in a 128K-wide and a tight
# table; the prefill merge main vs ranked; GPU tests of both trees
. .probe/setup.sh
for L in base:.baseline ranked:.probe/ranked strided:.probe/strided both:.probe/both; do D=${L#*:}; L=${L%%:*}
  PYTHONPATH=/tmp/site:$PWD/$D timeout 150 python3 $D/benchmarks/bench_index_decode.py --label $L-cap128k --kv bf16 \
    --requests 1,8,32,64 --contexts 3000,65536,131072 --capacity 131072 --json $OUT/index_cap128k_$L.json > $OUT/index_cap128k_$L.log 2>&1
  echo "== $L cap128k rc=$?"; grep "ctx" $OUT/index_cap128k_$L.log | cut -c1-110
  PYTHONPATH=/tmp/site:$PWD/$D timeout 60 python3 $D/benchmarks/bench_index_decode.py --label $L-tight --kv bf16 \
    --requests 1,8,32,64 --contexts 3000 --json $OUT/index_tight_$L.json > $OUT/index_tight_$L.log 2>&1
  echo "== $L tight rc=$?"; grep "ctx" $OUT/index_tight_$L.log | cut -c1-110
done
for L in base:.baseline both:.probe/both; do D=${L#*:}; L=${L%%:*}
  PYTHONPATH=/tmp/site:$PWD/$D timeout 100 python3 $D/benchmarks/bench_index_decode.py --label $L-prefill --kv bf16 --requests 1 \
    --contexts 3000,65536,131072 --prefill --json $OUT/index_prefill_$L.json > $OUT/index_prefill_$L.log 2>&1
  echo "== $L prefill rc=$?"; grep "prefill chunk" $OUT/index_prefill_$L.log | cut -c1-200
done
for L in both:.probe/both; do D=${L#*:}; L=${L%%:*}
  (cd $D && PYTHONPATH=/tmp/site:$PWD timeout 150 python3 -m pytest -q -rs --timeout 140 -m cuda tests/attn/test_triton_indexer.py \
    tests/attn/test_prefill_tiles.py > $OUT/tests_indexer_$L.log 2>&1); echo "== tests $L"; tail -2 $OUT/tests_indexer_$L.log
done
