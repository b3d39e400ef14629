# round 22's second call (c18), right after c16 on the same warm H100 (run as one command line): 32-pair tiles with
# a 16-pair tail in their pass against main's 64-pair tiles (first and last), kernels alone at 1054 and 2078 rows
# (~34 and ~64 pairs a routed expert: M3 routes a token to 4 of 128 experts, 16 local at TP8)
. .probe/setup.sh >/dev/null; M="fp8_mma=1,mma_f16=1"; C="$M,mma_block_t=64,mma_num_stages=4,mma_tail_t=32;$M,mma_block_t=32,mma_num_stages=4,mma_tail_t=16,mma_tail_in_pass=1;$M,mma_block_t=32,mma_num_stages=5,mma_tail_t=16,mma_tail_in_pass=1;$M,mma_block_t=32,mma_num_stages=4;$M,mma_block_t=32,mma_num_stages=4,mma_tail_t=16;$M,mma_block_t=64,mma_num_stages=4,mma_tail_t=32"; for t in 1054 2078; do PYTHONPATH=/tmp/site:$PWD timeout 200 python3 benchmarks/bench_moe_configs.py --tokens $t --kernels --configs "$C" --json $OUT/b_moe_$t.json > $OUT/b_moe_$t.log 2>&1; echo "moe $t rc=$?"; python3 -c "
import json; d = json.load(open('$OUT/b_moe_$t.json'))
for r in d['rows']:
    k = r.get('kernels_us', {}); print(r['T'], r['us'], k.get('_moe_mma_gate_up_kernel'), k.get('_moe_mma_down_kernel'), '%.2g' % r.get('rel_err', -1), r['spec'].split('mma_f16=1,')[-1])"; grep -i spread $OUT/b_moe_$t.log | cut -c1-220; done
