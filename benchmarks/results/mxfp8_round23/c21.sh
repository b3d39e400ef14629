# round 23's second call (c21), on the machine c20 warmed: on an H200 the issue's 60-layer bf16 steps on new
# (beside c20's MXFP8) and the bf16 MoE alone at 1054 rows, new then base; on an H100 60-layer MXFP8 decode 1 /
# 2, base, new, base (steps.sh; base's first run tunes its choices; c20 ran new's first), then the bf16 MoE alone
# at 1054 rows, new then base
. .probe/setup.sh
. .probe/tables.sh
. .probe/steps.sh
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "$mem" -gt 120000 ]; then
  table new . bf16 230; moe_alone new . bf16 100; moe_alone base .probe/base bf16 100; exit 0
fi
steps base .probe/base 130; steps new . 90; steps base .probe/base 90
moe_alone new . bf16 80; moe_alone base .probe/base bf16 80
