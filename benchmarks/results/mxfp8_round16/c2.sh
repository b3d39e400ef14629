# call 2: the 60-layer table, bf16 then MXFP8 (scripts/gpu_suite.sh mxfp8), this tree
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
[ "$mem" -lt 120000 ] && export MXFP8_ARGS="--layers 30"   # 60 bf16 layers (99.6 GiB) need an H200
PART_TIMEOUT_MXFP8=${PT:-585} bash scripts/gpu_suite.sh mxfp8 > /dev/null 2>&1; echo rc=$?
grep -E "built|spread \(|decode|mixed|chose moe (1|32|64|1054):" $OUT/suite.log | grep -v "eager GPU" | cut -c1-330
