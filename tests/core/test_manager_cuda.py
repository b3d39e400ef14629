"""Real capture and replay on a GPU: the toy transformer through CaptureManager."""

import pytest
import torch

from graphcap import CaptureConfig, CaptureManager, CaptureViolation, GraphKey, Purpose, splice
from graphcap.verify.compare import relative_error
from models.toy import ToyConfig
from models.toy.bare import ToySource, ToyTransformer, make_step, toy_static_inputs

pytestmark = pytest.mark.cuda

CFG = ToyConfig(num_layers=4, hidden=256, num_heads=4, vocab=512, max_seqs=16, max_len=128, max_tokens=64)
BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def build(config: CaptureConfig, forward=None, seed=0):
    torch.manual_seed(seed)
    model = ToyTransformer(CFG, "cuda", torch.bfloat16)
    manager = CaptureManager(forward or model.forward, toy_static_inputs(CFG, "cuda"), config, ToySource(model))
    manager.register("model", model)
    manager.register("kv_cache", model.cache_tensors, mutable=True)
    return model, manager


def eager_of(model, step):
    """Plain eager logits for a step, with the cache restored afterwards."""
    k, v = model.k_cache.clone(), model.v_cache.clone()
    ref_manager = CaptureManager(model.forward, toy_static_inputs(CFG, "cuda"),
                                 CaptureConfig(max_tokens=CFG.max_tokens), ToySource(model))
    out = ref_manager.run(step).clone()
    kk, vv = model.k_cache.clone(), model.v_cache.clone()
    model.k_cache.copy_(k), model.v_cache.copy_(v)
    return out, kk, vv


def random_step(g, decode):
    if decode:
        n = int(torch.randint(1, CFG.max_seqs + 1, (1,), generator=g))
        seqs = torch.randperm(CFG.max_seqs, generator=g)[:n].tolist()
        return make_step(CFG, [(s, int(torch.randint(1, CFG.max_len - 1, (1,), generator=g)), 1) for s in seqs], g)
    chunks = []
    for s in torch.randperm(CFG.max_seqs, generator=g)[:3].tolist():
        n = int(torch.randint(1, 20, (1,), generator=g))
        chunks.append((s, int(torch.randint(0, CFG.max_len - n, (1,), generator=g)), n))
    return make_step(CFG, chunks, g)


@pytest.mark.parametrize("decode", [False, True])
def test_replay_matches_eager_across_steps(decode):
    model, manager = build(CaptureConfig(enabled=True, max_tokens=CFG.max_tokens, buckets=BUCKETS))
    manager.capture()
    g = torch.Generator().manual_seed(1)
    model.k_cache.normal_(), model.v_cache.normal_()  # a populated cache: attention reads real context
    for i in range(8):
        step = random_step(g, decode)
        ref, k_ref, v_ref = eager_of(model, step)
        out = manager.run(step)
        assert relative_error(out, ref) < 2e-2, f"step {i}"
        real = slice(0, CFG.max_seqs)
        assert relative_error(model.k_cache[:, real], k_ref[:, real]) < 1e-2
    bucket_stats = [s for s in manager.stats.buckets.values() if s.hits]
    assert bucket_stats and all(s.status == "captured" for s in bucket_stats)
    assert all(s.key.decode == decode for s in bucket_stats)
    if not decode:
        graph = manager.graph(GraphKey(BUCKETS[-1], False))
        assert graph.key == GraphKey(BUCKETS[-1], False)
        assert graph.num_segments == CFG.num_layers + 1 and graph.splice_names == ["toy.attention"] * CFG.num_layers


def test_validation_passes_for_a_correct_model_and_stats_fill():
    model, manager = build(CaptureConfig(enabled=True, max_tokens=CFG.max_tokens, buckets=BUCKETS, validate=True))
    manager.capture()
    assert manager.failures == {}
    for s in manager.stats.buckets.values():
        assert s.status == "captured" and s.capture_ms > 0


class FrozenScalarModel(ToyTransformer):
    """A bad producer: a per-step Python float read in captured code."""

    temperature = 1.0

    def forward(self, inputs):
        return super().forward(inputs) * self.temperature


class OutsideTensorModel(ToyTransformer):
    """A bad producer: reads a tensor the caller replaces every step (not a static buffer)."""

    bias = None

    def forward(self, inputs):
        return super().forward(inputs) + self.bias


@pytest.mark.parametrize("kind", ["scalar", "tensor"])
def test_validation_drops_bad_producers(kind):
    torch.manual_seed(0)
    model = (FrozenScalarModel if kind == "scalar" else OutsideTensorModel)(CFG, "cuda", torch.bfloat16)
    model.bias = torch.zeros(CFG.vocab, device="cuda", dtype=torch.bfloat16)
    # Keep replaced tensors alive: otherwise the allocator may hand the freed block straight
    # back to the new tensor and the stale read would be right by accident.
    old_biases = []

    class ChangingSource(ToySource):
        """Validation steps come with a new value of what the bad producer reads."""

        def dummy_step(self, key, purpose):
            if purpose is Purpose.VALIDATE:
                if kind == "scalar":
                    model.temperature = 3.0 + key.rows  # differs from the value frozen at capture
                else:
                    old_biases.append(model.bias)
                    model.bias = torch.randn(CFG.vocab, device="cuda", dtype=torch.bfloat16) * 10
            return super().dummy_step(key, purpose)

    config = CaptureConfig(enabled=True, max_tokens=CFG.max_tokens, buckets=(4, 8))
    source = ChangingSource(model)
    manager = CaptureManager(model.forward, toy_static_inputs(CFG, "cuda"), config, source)
    manager.register("kv_cache", model.cache_tensors, mutable=True)
    manager.capture()
    failures = manager.validate()
    assert set(failures) == {GraphKey(4, False), GraphKey(8, False), GraphKey(4, True), GraphKey(8, True)}
    assert all("differs from eager" in r for r in failures.values())
    assert manager.failures == failures
    assert manager.graph(4) is None and GraphKey(4, False) not in manager.table
    # Dropped graphs run eagerly, and correctly.
    step = source.dummy_step(GraphKey(4, False), Purpose.VALIDATE)
    out = manager.run(step)
    ref, _, _ = eager_of(model, step)
    assert relative_error(out, ref) < 2e-2
    assert manager.stats.dropped_fallbacks == 1


def test_padded_rows_writing_the_cache_fail_validation():
    torch.manual_seed(0)
    model = ToyTransformer(CFG, "cuda", torch.bfloat16)
    orig = model._write_cache
    # Bad producer: ignores slot -1 and writes padded rows into sequence 0's row.
    model._write_cache = lambda layer, slots, k, v: orig(layer, slots.clamp(min=0), k, v)

    class PaddedValidation(ToySource):
        """Validation on a step of 5 real tokens: graph 8 replays it with 3 padded rows."""

        def dummy_step(self, key, purpose):
            if purpose is Purpose.VALIDATE:
                return make_step(CFG, [(3, 0, 5)])
            return super().dummy_step(key, purpose)

    config = CaptureConfig(mode="piecewise", max_tokens=CFG.max_tokens, buckets=(8,))
    manager = CaptureManager(model.forward, toy_static_inputs(CFG, "cuda"), config, PaddedValidation(model))
    manager.register("kv_cache", model.cache_tensors, mutable=True)
    manager.capture()
    failures = manager.validate()
    assert "padded rows must write nothing" in failures[GraphKey(8, False)]


def test_host_sync_in_capture_names_the_op_and_leaves_manager_usable():
    model, manager = build(CaptureConfig(enabled=True, max_tokens=CFG.max_tokens, buckets=(4,)))
    orig = model.norm.forward
    model.norm.forward = lambda x: orig(x) * float(x.abs().max().item() > 0)
    with pytest.raises(CaptureViolation, match=r"_local_scalar_dense.*test_manager_cuda.py"):
        manager.capture()
    model.norm.forward = orig
    manager.capture()  # the failed capture left the stream usable
    assert manager.graph(4) is not None


def test_cpu_tensor_read_in_capture_is_caught():
    model, manager = build(CaptureConfig(enabled=True, max_tokens=CFG.max_tokens, buckets=(4,)))
    table = torch.ones(CFG.vocab)
    orig = model.norm.forward
    model.norm.forward = lambda x: orig(x) * table[: x.shape[1]].to(x.device)
    with pytest.raises(CaptureViolation, match="CPU tensor"):
        manager.capture()


def test_reallocated_weight_triggers_recapture_never_a_stale_read():
    model, manager = build(CaptureConfig(enabled=True, max_tokens=CFG.max_tokens, buckets=(4, 8)))
    manager.capture()
    step = make_step(CFG, [(0, 0, 3)])
    manager.run(step)
    old = model.lm_head.weight.data
    model.lm_head.weight.data = torch.randn_like(old)  # new storage
    del old
    torch.cuda.empty_cache()
    ref, _, _ = eager_of(model, step)
    out = manager.run(step)
    assert manager.stats.invalidations == 1 and manager.stats.recaptures == 1
    assert relative_error(out, ref) < 2e-2


def test_buckets_share_one_pool():
    buckets = BUCKETS
    torch.cuda.synchronize()
    model, shared = build(CaptureConfig(mode="piecewise", max_tokens=CFG.max_tokens, buckets=buckets))
    shared.capture()
    shared_mib = shared.stats.memory_mib
    separate = []
    for b in buckets:
        m = CaptureManager(
            model.forward, toy_static_inputs(CFG, "cuda"),
            CaptureConfig(mode="piecewise", max_tokens=CFG.max_tokens, buckets=(b,)), ToySource(model),
        )
        m.capture()
        separate.append(m.stats.memory_mib)
    print(f"one pool: {shared_mib:.1f} MiB; separate pools: {sum(separate):.1f} MiB ({separate})")
    assert shared_mib < 0.6 * sum(separate)


def test_adjacent_splices_and_non_graph_safe_splice_skip_full_graph():
    calls = []

    @splice("test.host_loop")  # not graph-safe: a decode graph must not capture through it
    def host_side(x, out):
        calls.append(int(x.shape[0]))
        out.copy_(x)

    torch.manual_seed(0)
    model = ToyTransformer(CFG, "cuda", torch.bfloat16)

    def forward(inputs):
        logits = model.forward(inputs)
        tmp = torch.empty_like(logits)
        host_side(logits, tmp)
        out = torch.empty_like(tmp)
        host_side(tmp, out)  # adjacent splice: an empty segment between them
        return out * 2

    manager = CaptureManager(forward, toy_static_inputs(CFG, "cuda"),
                             CaptureConfig(enabled=True, max_tokens=CFG.max_tokens, buckets=(4,)), ToySource(model))
    manager.capture()
    decode = manager.stats.graph(GraphKey(4, True))
    assert decode.status == "skipped" and "test.host_loop" in decode.reason
    assert manager.graph(4, decode=True) is None and manager.graph(4, decode=False) is not None
    step = make_step(CFG, [(0, 5, 1), (1, 6, 1)])
    calls.clear()
    out = manager.run(step)
    assert calls == [4, 4]
    ref = eager_of(model, step)[0] * 2
    assert relative_error(out, ref) < 2e-2


class StepScalarModel(ToyTransformer):
    """A bad producer: the plan stores a Python scalar from the step and captured code uses it
    as a kernel argument (every replay would reuse the capture's value)."""

    scale = 1.0

    def forward(self, inputs):
        return super().forward(inputs) * self.scale


def other_dummy(key: GraphKey):
    """Other dummy data than ``ToySource``'s: fewer real tokens, other rows and positions."""
    n = max(1, key.rows - key.rows // 4)
    if key.decode:
        return make_step(CFG, [((CFG.max_seqs - 1 - i) % CFG.max_seqs, 7 + i // CFG.max_seqs, 1) for i in range(n)])
    return make_step(CFG, [(3, 5, n)])


class StepScalarSource(ToySource):
    """Plans a host value of the step into the model (``scale``); frozen-value checks run on
    ``other_dummy``."""

    def plan(self, step, padding):
        super().plan(step, padding)
        self.model.scale = 1.0 + step.num_tokens / 64  # a host value of the step

    def dummy_step(self, key, purpose):
        if purpose is Purpose.FROZEN_CHECK:
            return other_dummy(key)
        return super().dummy_step(key, purpose)


@pytest.mark.parametrize("bad", [True, False])
def test_frozen_value_detection_finds_a_baked_step_scalar_and_nothing_else(bad):
    torch.manual_seed(0)
    model = (StepScalarModel if bad else ToyTransformer)(CFG, "cuda", torch.bfloat16)
    config = CaptureConfig(enabled=True, max_tokens=CFG.max_tokens, buckets=(4, 8, 64), detect_frozen=True)
    manager = CaptureManager(model.forward, toy_static_inputs(CFG, "cuda"), config, StepScalarSource(model))
    manager.register("kv_cache", model.cache_tensors, mutable=True)
    manager.capture()
    failures = manager.detect_frozen()
    assert manager.stats.frozen_s > 0
    if not bad:
        assert failures == {}, failures  # no false positive: pointers differ, nothing else
        return
    # Every graph whose dummy steps differ in real tokens bakes another scale; a graph of 1 row has one.
    assert set(failures) == {k for k in manager.keys() if k.rows > 1}
    reason = failures[GraphKey(8, False)]
    assert "frozen host value" in reason and "parameter" in reason and f"segment {CFG.num_layers}" in reason
    assert manager.graph(8) is None and manager.stats.graph(GraphKey(8, False)).status == "dropped"
    step = other_dummy(GraphKey(8, False))  # the dropped graph now runs eagerly, with this step's scale
    out = manager.run(step)
    ref, _, _ = eager_of(model, step)
    assert relative_error(out, ref) < 2e-2  # eager multiplies by this step's scale too


def test_detect_frozen_needs_kept_graphs():
    model, manager = build(CaptureConfig(enabled=True, max_tokens=CFG.max_tokens, buckets=(4,)))
    manager.capture()
    with pytest.raises(ValueError, match="detect_frozen=True"):
        manager.detect_frozen()


def test_capture_out_of_memory_frees_everything_and_says_what_to_change():
    from graphcap.memory import CaptureOutOfMemory

    model, manager = build(CaptureConfig(enabled=True, max_tokens=CFG.max_tokens, buckets=(4, 8, 64)))
    orig = model.norm.forward

    def hungry(x):
        if torch.cuda.is_current_stream_capturing() and x.shape[0] == 8:
            torch.empty(1 << 50, dtype=torch.uint8, device="cuda")  # a petabyte
        return orig(x)

    manager.capture()  # steady state first: cuBLAS workspaces of the capture stream stay allocated
    manager.release()
    model.norm.forward = hungry
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    with pytest.raises(CaptureOutOfMemory, match=r"capturing graph 8 piecewise, .*graph\(s\) captured holding .*"
                                                 r"Capture fewer graphs \(CaptureConfig.buckets / decode_buckets\)"
                       ) as err:
        manager.capture()
    assert isinstance(err.value, torch.OutOfMemoryError)
    assert manager.graph(64) is None and manager.graph(64, True) is None and manager._pool is None
    del err
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= allocated + 2**20  # the pool and the graphs' tensors are gone
    model.norm.forward = orig
    manager.capture()
    assert manager.graph(64) is not None


def test_capture_reports_phases_and_pool_and_one_graph_per_shape():
    torch.manual_seed(0)
    model = ToyTransformer(CFG, "cuda", torch.bfloat16)
    manager = CaptureManager(model.forward, toy_static_inputs(CFG, "cuda"),
                             CaptureConfig(enabled=True, max_tokens=CFG.max_tokens, validate=True), ToySource(model),
                             request_capacity=CFG.max_seqs)
    manager.register("kv_cache", model.cache_tensors, mutable=True)
    manager.capture()
    s = manager.stats
    assert s.warmup_s > 0 and s.capture_s > 0 and s.validate_s > 0 and s.pool_mib > 0
    # Derived buckets: decode graphs up to max_seqs=16, piecewise graphs only above.
    assert manager.decode_buckets == (1, 2, 4, 8, 12, 16) and manager.piecewise_buckets == (24, 32, 48, 64)
    assert all(st.status == "captured" for st in s.buckets.values())
