# call 2 (round 17): 60-layer MXFP8 steps (decode 1/8/32/64 and mixed 30+1024), trees in $TREES (label:dir ...)
. .probe/setup.sh
STEPS_ARGS="--decode 1,8,32,64 --iters 10 --top-kernels 12" RUN_TIMEOUT=${RT:-150} bash .probe/steps.sh $TREES 2>&1 | grep -v "chose\|spread"
grep -h "largest" $OUT/steps_*.log | grep "decode 1:\|decode 32\|mixed" | cut -c1-300
