# round 22's short H200 call (c19), for the last ~6 minutes of a session's device time: the issue's 60-layer MXFP8
# steps on main (decode 1 against the <= 60 us target, decode 32 / 64 against the fp8 floor, mixed 30 + 1024), fresh
# kernel choices, 10 timed steps (DECODE and LIMIT override the decode sizes and the time box); on an H100 nothing
# (round 21's c15.sh covers it)
. .probe/setup.sh
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
[ "$mem" -gt 120000 ] || { echo "not an H200"; exit 0; }
GRAPHCAP_CACHE_DIR=/tmp/ch_main PYTHONPATH=/tmp/site:$PWD timeout ${LIMIT:-250} \
  python3 benchmarks/bench_steps.py --label mxfp8 \
  --routing uniform --quantization mxfp8 --decode ${DECODE:-1,32,64} --iters 10 --top-kernels 10 \
  --json $OUT/h_steps_mxfp8.json > $OUT/h_steps_mxfp8.log 2>&1; echo "mxfp8 rc=$?"
grep -E "built|decode|mixed" $OUT/h_steps_mxfp8.log | grep -v "chose\|eager GPU\|largest" | cut -c1-330
