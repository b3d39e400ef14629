# round 21's short call (c15), for a session's last few minutes of device time: on an H200 the issue's 60-layer
# MXFP8 steps alone (c8.sh's MXFP8 half: decode 1 against the <= 60 us target); on an H100 main then .probe/base
# (`git archive fab6bcb`) then main, decode 1 / 2, with capture seconds (no throwaway run: the first is the fresh
# machine's); setup as c14.sh
. .probe/setup.sh
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "$mem" -gt 120000 ]; then
  GRAPHCAP_CACHE_DIR=/tmp/ch_main PYTHONPATH=/tmp/site:$PWD timeout 300 python3 benchmarks/bench_steps.py --label mxfp8 \
    --routing uniform --quantization mxfp8 --decode 1,8,32,64 --iters 10 --top-kernels 10 \
    --json $OUT/s_steps_mxfp8.json > $OUT/s_steps_mxfp8.log 2>&1; echo "mxfp8 rc=$?"
  grep -E "built|decode|mixed" $OUT/s_steps_mxfp8.log | grep -v "chose\|eager GPU\|largest" | cut -c1-330
  python3 -c "import json; print('capture_s', json.load(open('$OUT/s_steps_mxfp8.json')).get('capture_s'))"
  exit 0
fi
. .probe/steps.sh
steps main . 200; steps base .probe/base 110; steps main . 90
