# round 22's first call (c16): the f16-form MoE with an expert's last pairs in its last full tile's K pass
# (MoEConfig.mma_tail_in_pass, mma_tail_in_pass.diff) against separate passes, kernels alone at 1054 and 768 rows
# (~34 / ~24 pairs a routed expert), then the GPU tests of the MoE kernel file's f16-form and tail tests
# (setup: copy ../mxfp8_round15/setup.sh and this folder's scripts into .probe/)
. .probe/setup.sh
M="fp8_mma=1,mma_f16=1,mma_block_t=64"
C="$M,mma_num_stages=4,mma_tail_t=32;$M,mma_num_stages=3,mma_tail_t=32;$M,mma_num_stages=3,mma_tail_t=32,mma_tail_in_pass=1"
C="$C;$M,mma_num_stages=4,mma_tail_t=16,mma_tail_in_pass=1;$M,mma_num_stages=3,mma_tail_t=16,mma_tail_in_pass=1"
for t in 1054 768; do
  PYTHONPATH=/tmp/site:$PWD timeout 170 python3 benchmarks/bench_moe_configs.py --tokens $t --kernels --configs "$C" \
    --json $OUT/a_moe_$t.json > $OUT/a_moe_$t.log 2>&1; echo "moe $t rc=$?"
  python3 -c "
import json; d = json.load(open('$OUT/a_moe_$t.json'))
for r in d['rows']:
    k = r.get('kernels_us', {}); print(r['T'], r['us'], k.get('_moe_mma_gate_up_kernel'), k.get('_moe_mma_down_kernel'),
          '%.2g' % r.get('rel_err', -1), r['spec'].split('block_t=64,')[-1])" 2>&1 | tail -6
  grep -i "spread" $OUT/a_moe_$t.log | head -1 | cut -c1-200
done
PYTHONPATH=/tmp/site:$PWD timeout 200 python3 -m pytest -q -rs --timeout 190 -m cuda tests/model/test_m3_moe_kernels.py \
  -k "tail or f16 or real_shapes" > $OUT/a_tests_moe.log 2>&1; echo "tests rc=$?"; tail -3 $OUT/a_tests_moe.log
