# the A/B step runs of c14.sh and c15.sh (sourced from .probe/; setup as in README.md): 60-layer MXFP8 decode 1 / 2
# in the tree $2, each label with its own choice store, printing the spans and MoE choices of this run (the newest log;
# in the calls of round 21 the glob printed a label's first run again) and the capture seconds of every run so far
steps() {  # label tree timeout
  GRAPHCAP_CACHE_DIR=/tmp/ch_$1 PYTHONPATH=/tmp/site:$PWD/$2 timeout $3 python3 benchmarks/bench_steps.py --label $1 \
    --routing uniform --quantization mxfp8 --decode 1,2 --iters 20 --top-kernels 6 --chunk 128 --mixed-decodes 1 \
    --json $OUT/r_steps_$1$SECONDS.json > $OUT/r_steps_$1$SECONDS.log 2>&1; echo "$1 rc=$?"
  grep -hE "decode (1|2): wall|chose moe (1|2):" $(ls -t $OUT/r_steps_$1*.log | head -1) \
    | grep -o "chose moe [12]: config[0-9]*\|gemv_block_n=[0-9]*\|decode [12]: wall.*graph span .\{22\}" | tr '\n' ' '
  python3 -c "import json,sys; print(' capture_s', [json.load(open(f)).get('capture_s') for f in sys.argv[1:]])" \
    $(ls -tr $OUT/r_steps_$1*.json 2>/dev/null)
}
