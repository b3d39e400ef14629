# round 21's first call (c14): on an H100, a throwaway run first (a fresh machine's first run reads its MoE kernels
# 1-3 us slower), then main (the MoE tuner's 16-row probes, their reference on the routed experts only) and
# .probe/base (`git archive fab6bcb`: one probe, before the shared expert's rows) alternating at decode 1 / 2,
# with capture seconds (the first run of a tree tunes, the second validates its stored choices);
# on an H200 the 60-layer table (c8.sh: MXFP8 then bf16) on main
# (setup: copy ../mxfp8_round15/setup.sh, ../mxfp8_round19/c8.sh and steps.sh into .probe/, .probe/base as above)
. .probe/setup.sh
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "$mem" -gt 120000 ]; then bash .probe/c8.sh; exit 0; fi
. .probe/steps.sh
steps warm . 200
for i in 1 2; do steps main . 90; steps base .probe/base 90; done
