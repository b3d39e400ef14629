"""No Triton compile after capture (GPU): a captured runner serves prefill chunks at growing
contexts, of every size up to the ceiling, alone and mixed with decodes, and none of those
steps builds a kernel (each build would stall every request of its step for ~1 s).

The eager splices (sparse attention, the indexer) see a new token count and context on every
prefill step; their kernels are built once for all of them (unspecialised step counts, fixed
merge pieces) and the capture's warm-up steps mix a chunk with a one-token request, the two
tile paths a serving step takes. In mode decode those steps run eagerly at their own sizes:
the capture also warms the sizes a piecewise graph would have had, and no eager step validates
a kernel choice of its own (the tuner's choices are those of the capture)."""

import pytest
import torch

from graphcap import CaptureConfig
from models.minimax_m3 import MiniMaxM3Config, build_from_preset
from steps import TokenChunk

pytestmark = pytest.mark.cuda


def described(events) -> str:
    return "; ".join(f"{e.kernel}: {e.key}" for e in events)


# tiny (4-token key blocks: many block counts) on the Triton kernels, dense fallback included
# (flashinfer has no kernels for its head_dim 32); rank-of-8 shapes (4 layers, one sparse) on
# flashinfer's dense layers and the Triton sparse ones, as served.
CASES = [("tiny", "triton", "full_and_piecewise"), ("tiny", "triton_tiles", "full_and_piecewise"),
         ("tiny", "triton_per_token", "full_and_piecewise"),
         ("rank-of-8:4", "auto", "full_and_piecewise"), ("tiny", "triton", "decode"), ("rank-of-8:4", "auto", "decode")]


@pytest.mark.parametrize("preset,backend,mode", CASES, ids=[f"{p}-{b}-{m}" for p, b, m in CASES])
def test_prefill_steps_at_any_context_compile_nothing_after_capture(preset, backend, mode):
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU (run scripts/gpu_suite.sh on the device)")
    name, _, layers = preset.partition(":")
    config = MiniMaxM3Config.preset(name)
    config = config.first_layers(int(layers)) if layers else config
    runner = build_from_preset(config, "cuda", torch.bfloat16, backend=backend, max_tokens=64, max_seqs=4,
                               max_seq_len=4096, capture=CaptureConfig(mode=mode, max_tokens=64))
    runner.capture()
    assert runner.compiles_after_capture() == []
    tuner = runner.model.ops.tuner
    choices = set(tuner.choices) if tuner is not None else set()
    gen = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(0, runner.vocab_size, (n,), generator=gen).tolist()

    runner.add_request("long")
    runner.add_request("d0")
    runner.add_request("d1")
    runner.run_chunks([TokenChunk("d0", 0, ids(40)), TokenChunk("d1", 0, ids(23))])
    pos, step, sizes = 0, 0, [64, 61, 17, 3, 2, 48, 33, 64]
    written = {"d0": 40, "d1": 23}
    while pos < 3000:  # contexts crossing many key-block counts (tiny: 4-token blocks)
        n = sizes[step % len(sizes)]
        chunks = [TokenChunk("long", pos, ids(n))]
        if step % 3:  # mixed with decodes (and their one-token tiles)
            room = 64 - n
            for sid in ("d0", "d1")[:max(0, min(2, room))]:
                chunks.append(TokenChunk(sid, written[sid], ids(1)))
                written[sid] += 1
        runner.run_chunks(chunks)
        pos, step = pos + n, step + 1
    torch.cuda.synchronize()
    after = runner.compiles_after_capture()
    assert after == [], f"{len(after)} compiles after capture: {described(after)}"
    if tuner is not None:
        assert set(tuner.choices) == choices, f"validated after capture: {set(tuner.choices) - choices}"
    runner.destroy()
