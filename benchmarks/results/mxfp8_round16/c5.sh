# call 5: the steps again, trees in the other order; then GPU tests of the touched kernels and the MoE replays
. .probe/setup.sh
STEPS_ARGS="--decode 1,8,32,64 --iters 10 --top-kernels 12" RUN_TIMEOUT=150 bash .probe/steps.sh new2:. base2:.baseline 2>&1 | grep -v "chose\|spread" | grep -v "eager GPU"
PYTHONPATH=/tmp/site:$PWD timeout 280 python3 -m pytest -q -rs --timeout 200 -m cuda tests/attn tests/model/test_m3_moe_kernels.py tests/model/test_mxfp8.py -k "not long and not soak" > $OUT/tests_gpu.log 2>&1
tail -6 $OUT/tests_gpu.log
