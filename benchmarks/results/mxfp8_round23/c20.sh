# round 23's first call (c20): main with shared_first.diff applied ("new": the shared expert's programs first in the
# tile MoE's launch order, its gate/up before the PDL wait in the weight-row MoE) against main without it ("base",
# .probe/base = `git archive HEAD -- ':!benchmarks/results'` taken before applying). Setup: copy
# ../mxfp8_round15/setup.sh, ../mxfp8_round21/steps.sh and tables.sh into .probe/, carry .whl and .probe. First the
# GPU tests of the changed kernels: every MoE candidate at real shapes against the torch twin; graph replays equal to
# eager of the MoE paths, of the weight-row MoE behind a norm and its router as the model runs it, and of the MXFP8
# model; PDL. Then on an H200 the 60-layer MXFP8 steps (decode 1, 8, 32, 64, mixed 30 + 1024), new then
# base; on an H100 the MXFP8 MoE kernels alone at 1054 rows (the f16 form), new then base, and 60-layer MXFP8
# decode 1 / 2 on new (its first run tunes; c21 has the rest of the H100's decode A/B)
. .probe/setup.sh
. .probe/tables.sh
PYTHONPATH=/tmp/site:$PWD timeout 160 python3 -m pytest -q -rs --timeout 150 -m cuda tests/attn/test_pdl.py \
  tests/model/test_m3_moe_kernels.py tests/model/test_mxfp8.py -k "pdl or replay or real_shapes" > $OUT/t_tests.log 2>&1
echo "tests rc=$?"; tail -2 $OUT/t_tests.log
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "$mem" -gt 120000 ]; then table new . mxfp8 230; table base .probe/base mxfp8 200; exit 0; fi
. .probe/steps.sh
moe_alone new . mxfp8 100; moe_alone base .probe/base mxfp8 80; steps new . 170
