# call 3: serving, bf16 then MXFP8, the same requests (scripts/gpu_suite.sh mxserve)
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
[ "$mem" -lt 120000 ] && export MXSERVE_ARGS="--layers 30"
PART_TIMEOUT_MXSERVE=${PT:-585} bash scripts/gpu_suite.sh mxserve > /dev/null 2>&1; echo rc=$?
tail -45 $OUT/suite.log | cut -c1-200
