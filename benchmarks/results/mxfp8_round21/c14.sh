# round 21's first call (c14): on an H100, a throwaway run first (a fresh machine's first run reads its MoE kernels
# 1-3 us slower), then main (the MoE tuner's 16-row probes, their reference on the routed experts only) and
# .probe/base (`git archive fab6bcb`: one probe, before the shared expert's rows) alternating at decode 1 / 2,
# with capture seconds (the first run of a tree tunes, the second validates its stored choices);
# on an H200 the 60-layer table (c8.sh: MXFP8 then bf16) on main
# (setup: copy ../mxfp8_round15/setup.sh and ../mxfp8_round19/c8.sh into .probe/, .probe/base as above)
. .probe/setup.sh
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "$mem" -gt 120000 ]; then bash .probe/c8.sh; exit 0; fi
steps() {  # label tree timeout
  GRAPHCAP_CACHE_DIR=/tmp/ch_$1 PYTHONPATH=/tmp/site:$PWD/$2 timeout $3 python3 benchmarks/bench_steps.py --label $1 \
    --routing uniform --quantization mxfp8 --decode 1,2 --iters 20 --top-kernels 6 --chunk 128 --mixed-decodes 1 \
    --json $OUT/r_steps_$1$SECONDS.json > $OUT/r_steps_$1$SECONDS.log 2>&1; echo "$1 rc=$?"
  grep -hE "decode (1|2): wall|chose moe (1|2):" $OUT/r_steps_$1*.log | tail -4 \
    | grep -o "chose moe [12]: config[0-9]*\|gemv_block_n=[0-9]*\|decode [12]: wall.*graph span .\{22\}" | tr '\n' ' '
  python3 -c "import json,sys; print(' capture_s', [json.load(open(f)).get('capture_s') for f in sys.argv[1:]])" \
    $(ls -tr $OUT/r_steps_$1*.json 2>/dev/null)
}
steps warm . 200
for i in 1 2; do steps main . 90; steps base .probe/base 90; done
