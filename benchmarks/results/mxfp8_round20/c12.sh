# round 20 (c12): 60-layer MXFP8 decode 1 / 2, the tree with the shared expert's gate/up rows and the MoE tuner's
# 16-row probes (here) then main (.probe/base); uniform routing, context 3000
. .probe/setup.sh
for L in new:.:150 base:.probe/base:80; do D=${L#*:}; T=${D#*:}; D=${D%%:*}; L=${L%%:*}
  GRAPHCAP_CACHE_DIR=/tmp/ch_$L PYTHONPATH=/tmp/site:$PWD/$D timeout $T python3 benchmarks/bench_steps.py --label $L \
    --routing uniform --quantization mxfp8 --decode 1,2 --iters 20 --top-kernels 6 --chunk 128 --mixed-decodes 1 \
    --json $OUT/q_steps_$L.json > $OUT/q_steps_$L.log 2>&1; echo "$L rc=$?"
  grep -E "decode (1|2): wall|chose moe (1|2):" $OUT/q_steps_$L.log | grep -o "chose moe [12]: config[0-9]*\|gemv_block_n=[0-9]*\|decode [12]: wall.*graph span .\{22\}" | tr '\n' ' '; echo
done
