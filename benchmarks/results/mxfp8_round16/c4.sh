# call 4: 60-layer MXFP8 steps, .baseline then this tree (the ranked merge in the step)
. .probe/setup.sh
STEPS_ARGS="--decode 1,8,32,64 --iters 10 --top-kernels 12" RUN_TIMEOUT=${RT:-150} bash .probe/steps.sh base:.baseline new:. 2>&1 | grep -v "chose\|spread"
grep -h "largest" $OUT/steps_*.log | grep "decode 1:\|decode 32\|mixed" | cut -c1-400
