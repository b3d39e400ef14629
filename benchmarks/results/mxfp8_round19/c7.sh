# round 19 call (c7), right after c6 on the same warm machine: on an H200 serving bf16 vs MXFP8 (scripts/gpu_suite.sh
# mxserve: c30 default workload, the same requests); on an H100 the MXFP8 and model GPU tests
. .probe/setup.sh
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "$mem" -gt 120000 ]; then
  PART_TIMEOUT_MXSERVE=380 bash scripts/gpu_suite.sh mxserve > /dev/null 2>&1; echo "suite rc=$?"
  grep -E "per-user|TTFT|steps \(p50|vs full" $OUT/suite.log | cut -c1-200 | tail -14
  exit 0
fi
PYTHONPATH=/tmp/site:$PWD timeout 200 python3 -m pytest -q -rs --timeout 190 -m cuda tests/model/test_mxfp8.py \
  tests/model/test_m3_model.py > $OUT/g_tests_model.log 2>&1; echo "tests rc=$?"; tail -3 $OUT/g_tests_model.log
