# round 23's step and kernel runs (sourced from .probe/ by c20.sh, c21.sh; setup as in README.md)
table() {  # label tree mxfp8|bf16 timeout: the 60-layer steps (uniform routing, context 3000, 10 timed steps)
  flag=""; [ "$3" = mxfp8 ] && flag="--quantization mxfp8"
  GRAPHCAP_CACHE_DIR=/tmp/ch_$1 PYTHONPATH=/tmp/site:$PWD/$2 timeout $4 python3 benchmarks/bench_steps.py \
    --label $1_$3 --routing uniform $flag --decode 1,8,32,64 --iters 10 --top-kernels 12 \
    --json $OUT/s_$1_$3.json > $OUT/s_$1_$3.log 2>&1; echo "table $1 $3 rc=$?"
  grep -E "built|: wall|MoE per" $OUT/s_$1_$3.log | cut -c1-250
}
moe_alone() {  # label tree mxfp8|bf16 timeout: the fused MoE alone at 1054 rows (graph replays, weights rotating)
  if [ "$3" = mxfp8 ]; then
    PYTHONPATH=/tmp/site:$PWD/$2 timeout $4 python3 benchmarks/bench_moe_configs.py --tokens 1054 --kernels \
      --configs "fp8_mma=1,mma_f16=1,mma_block_t=64,mma_num_stages=4,mma_tail_t=32" --json $OUT/m_$1_$3.json \
      > $OUT/m_$1_$3.log 2>&1
  else
    PYTHONPATH=/tmp/site:$PWD/$2 timeout $4 python3 benchmarks/bench_m3_moe.py --tokens 1054 --no-compile \
      --no-mxfp8 --budget-s 60 --json $OUT/m_$1_$3.json > $OUT/m_$1_$3.log 2>&1
  fi
  echo "moe $1 $3 rc=$?"; python3 -c "
import json; d = json.load(open('$OUT/m_$1_$3.json')); rows = d['rows'] if isinstance(d, dict) else d
for r in rows:
    k = r.get('kernels_us', {}); keys = ('T', 'tokens', 'path', 'config', 'us', 'time_us')
    print(' ', {a: r[a] for a in keys if a in r}, {a: b for a, b in k.items() if 'gate_up' in a or 'down' in a})"
}
