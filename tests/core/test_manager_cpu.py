"""The manager on CPU: debug-eager path, splice ordering, guard errors, fallback counting."""

import dataclasses

import pytest
import torch

from graphcap import (
    CaptureConfig,
    CaptureManager,
    CaptureViolation,
    GraphKey,
    Padding,
    current_step,
    splice,
    step_context,
)
from models.toy import ToyConfig
from models.toy.bare import ToySource, ToyTransformer, make_step, toy_static_inputs

CFG = ToyConfig(num_layers=2, hidden=32, num_heads=4, vocab=64, max_seqs=6, max_len=32, max_tokens=32)


def toy_manager(config: CaptureConfig, seed: int = 0):
    torch.manual_seed(seed)
    model = ToyTransformer(CFG)
    manager = CaptureManager(model.forward, toy_static_inputs(CFG, "cpu"), config, ToySource(model))
    manager.register("model", model)
    manager.register("kv_cache", model.cache_tensors, mutable=True)
    return model, manager


def reference_logits(model, step):
    """Unpadded eager forward, no graphcap in the way."""
    padding = Padding.unpadded(step.num_tokens, step.num_seqs)
    ToySource(model).plan(step, padding)
    with step_context(step, padding):
        return model.forward({**step.inputs, "num_real_tokens": torch.tensor([step.num_tokens])})


@pytest.mark.parametrize("chunks", [[(0, 0, 5)], [(0, 0, 7), (1, 0, 3)], [(2, 4, 1), (3, 9, 1), (4, 0, 1)],
                                    [(0, 0, 32)]])
def test_debug_eager_matches_plain_eager(chunks):
    model, manager = toy_manager(CaptureConfig(enabled=True, debug_eager=True, max_tokens=32))
    g = torch.Generator().manual_seed(len(chunks))
    # Give decode chunks a real context first.
    ctx = [(s, 0, start) for s, start, _ in chunks if start > 0]
    if ctx:
        manager.run(make_step(CFG, ctx, g))
    step = make_step(CFG, chunks, g)
    k_before = model.k_cache.clone()
    out = manager.run(step)
    k_debug = model.k_cache.clone()
    model.k_cache.copy_(k_before)
    ref = reference_logits(model, step)
    assert out.shape == (step.num_tokens, CFG.vocab)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    real = slice(0, CFG.max_seqs)  # the last row is the sink padded rows write to
    # Padded GEMMs may round differently in the last bit; what was written must agree, and
    # nothing the unpadded run left untouched may change.
    torch.testing.assert_close(k_debug[:, real], model.k_cache[:, real], rtol=1e-5, atol=1e-5)
    stray = (k_debug[:, real] != k_before[:, real]) & (model.k_cache[:, real] == k_before[:, real])
    assert not stray.any(), "padded rows must not write the cache"
    padding = manager.padding_for(step)
    bucket = padding.rows
    assert bucket == next(b for b in (manager.decode_buckets if step.uniform_decode else manager.piecewise_buckets)
                          if b >= step.num_tokens)
    stats = manager.stats.graph(GraphKey(bucket, padding.decode_graph))
    assert stats.key == (bucket, padding.decode_graph) and stats.status == "eager"
    assert stats.hits == 1 and stats.padded_tokens == bucket - step.num_tokens


def test_padded_rows_leave_cache_untouched_except_sink():
    model, manager = toy_manager(CaptureConfig(enabled=True, debug_eager=True, max_tokens=32))
    before = model.k_cache.clone()
    step = make_step(CFG, [(1, 0, 5)])  # bucket 8: three padded rows with slot -1
    manager.run(step)
    changed = (model.k_cache != before).any(-1).any(-1)  # [L, seqs+1, max_len]
    assert changed[:, 1, :5].all()
    assert not changed[:, :CFG.max_seqs].clone().index_fill_(1, torch.tensor([1]), False).any()
    assert not changed[:, 1, 5:].any()


def test_splices_run_in_order_with_this_steps_metadata():
    model, manager = toy_manager(CaptureConfig(enabled=True, debug_eager=True, max_tokens=32))
    model.attention.record = True
    for n in (3, 9, 1):
        manager.run(make_step(CFG, [(0, 0, n)]))
    assert model.attention.calls == [(0, 3), (1, 3), (0, 9), (1, 9), (0, 1), (1, 1)]


def test_above_ceiling_runs_eagerly_and_is_counted():
    model, manager = toy_manager(CaptureConfig(enabled=True, debug_eager=True, max_tokens=8))
    step = make_step(CFG, [(0, 0, 20)])
    out = manager.run(step)
    model.k_cache.zero_(), model.v_cache.zero_()
    torch.testing.assert_close(out, reference_logits(model, step))
    assert manager.stats.fallbacks == 1


def test_disabled_runs_plain_eager():
    model, manager = toy_manager(CaptureConfig(enabled=False, max_tokens=32))
    step = make_step(CFG, [(0, 0, 4)])
    out = manager.run(step)
    model.k_cache.zero_(), model.v_cache.zero_()
    torch.testing.assert_close(out, reference_logits(model, step))
    assert manager.stats.eager_steps == 1 and not manager.stats.buckets


def test_host_sync_in_producer_names_segment_and_op():
    model, manager = toy_manager(CaptureConfig(enabled=True, debug_eager=True, max_tokens=32))
    layer = model.layers[1]
    orig = layer.o_proj.forward

    def syncing(x):
        if x.abs().max().item() > 1e9:  # a forgotten host sync in producer code
            return x
        return orig(x)

    layer.o_proj.forward = syncing
    with pytest.raises(CaptureViolation, match=r"segment 2 .*toy.attention.*_local_scalar_dense.*test_manager_cpu.py"):
        manager.run(make_step(CFG, [(0, 0, 4)]))


def test_boolean_mask_in_producer_is_caught():
    model, manager = toy_manager(CaptureConfig(enabled=True, debug_eager=True, max_tokens=32))
    orig = model.norm.forward
    model.norm.forward = lambda x: orig(x)[x[:, 0] > -1e9]
    with pytest.raises(CaptureViolation, match="boolean mask"):
        manager.run(make_step(CFG, [(0, 0, 4)]))


def test_metadata_read_outside_splice_is_an_error():
    model, manager = toy_manager(CaptureConfig(enabled=True, debug_eager=True, max_tokens=32))
    orig = model.norm.forward
    model.norm.forward = lambda x: orig(x) + 0 * len(current_step().metadata.positions)
    with pytest.raises(RuntimeError,
                       match=r"current_step\(\) was read by captured producer code at .*test_manager_cpu.py"):
        manager.run(make_step(CFG, [(0, 0, 4)]))


def test_splice_must_not_return_a_value():
    @splice("bad.returns")
    def bad(x):
        return x * 2

    with pytest.raises(RuntimeError, match="bad.returns.*returned a value"):
        bad(torch.ones(2))


def test_current_step_outside_a_step_raises():
    with pytest.raises(RuntimeError, match="outside a step"):
        current_step()


def test_max_tokens_beyond_static_buffers_is_rejected():
    model = ToyTransformer(CFG)
    with pytest.raises(ValueError, match="max_tokens"):
        CaptureManager(model.forward, toy_static_inputs(CFG, "cpu"), CaptureConfig(max_tokens=64))


def test_bucket_buffer_overflow_in_plan_is_clear():
    model = ToyTransformer(CFG)
    with pytest.raises(ValueError, match="capacity"):
        model.attention.plan(torch.zeros(40, dtype=torch.int64), torch.ones(40, dtype=torch.int64), 40)


def test_report_renders_and_coverage_attributes_splice_ops():
    from rich.console import Console

    from graphcap.report import measure_coverage, print_report

    model, manager = toy_manager(CaptureConfig(enabled=True, debug_eager=True, max_tokens=32))
    step = make_step(CFG, [(0, 0, 6)])
    cov = measure_coverage(manager, step)
    assert cov.unit == "aten ops"
    assert cov.in_graphs > 0 and cov.eager > 0
    assert set(cov.eager_by_site) == {"toy.attention"}  # every eager op sits in the attention splice
    assert cov.non_attention_eager() == {}
    console = Console(record=True, width=160)
    print_report(manager, cov, console)
    text = console.export_text()
    assert "graphcap graphs" in text and "toy.attention" in text and "piecewise" in text
    assert cov.graph_span_us == 0.0  # no kernel ran in a graph (CPU)


def test_graph_span_counts_gaps_and_overlaps_once():
    """The graph span runs from the first in-graph kernel's start to the last one's end: gaps
    between kernels count, kernels that overlap (programmatic dependent launch) count once,
    where ``busy_us`` sums their durations."""
    from graphcap.report import Coverage

    cov = Coverage(unit="kernels", in_graphs=3, in_graphs_us=10.0 + 10.0 + 5.0, graph_first_us=100.0,
                   graph_last_us=120.0)  # kernels [100, 110], [105, 115] (overlapping) and [115, 120]
    assert cov.graph_span_us == 20.0 and cov.busy_us == 25.0
    assert cov.as_dict()["graph_span_us"] == 20.0


def test_exposed_time_splits_the_span_between_overlapping_kernels():
    """Each kernel's exposed time is its part past the latest end before it: overlapped parts
    count once, a kernel inside another's time adds nothing, idle time is named by the kernel
    that ends it; the parts sum to the first start to the last end (to the graph span where
    kernels ran in graphs)."""
    from graphcap.report import Coverage

    cov = Coverage(unit="kernels", kernel_times=[(105.0, 115.0, "b"), (100.0, 110.0, "a"), (106.0, 108.0, "c"),
                                                 (118.0, 120.0, "a"), (119.0, 125.0, "d")])
    exposed = cov.exposed_us_by_name()
    assert exposed == {"a": 10.0 + 2.0, "b": 5.0, "(idle before) a": 3.0, "d": 5.0}
    assert sum(exposed.values()) == 125.0 - 100.0
    # with a graph: the kernels within its span only (a copy-in before it and the host's wait after
    # that left out), summing to the graph span
    cov.kernel_times.append((40.0, 45.0, "copy-in"))
    cov.graph_first_us, cov.graph_last_us = 100.0, 125.0
    assert cov.exposed_us_by_name() == exposed and sum(exposed.values()) == cov.graph_span_us


def test_one_padding_decision_reaches_prepare_and_the_splices():
    """Decode graphs pad request rows to the bucket; piecewise buckets keep the real ones."""
    model, manager = toy_manager(CaptureConfig(enabled=True, debug_eager=True, max_tokens=32, decode_buckets=(1, 2, 4)))
    seen = []
    plan = manager.source.plan
    manager.source.plan = lambda step, padding: (seen.append(padding), plan(step, padding))
    manager.run(make_step(CFG, [(0, 3, 1), (1, 5, 1), (2, 7, 1)]))  # decode of 3: decode graph 4
    manager.run(make_step(CFG, [(s, 1, 1) for s in range(6)]))  # decode of 6 > decode limit: piecewise 8
    manager.run(make_step(CFG, [(0, 0, 5)]))  # prefill: piecewise 8
    assert seen == [Padding(3, 3, 4, 4, True, True), Padding(6, 6, 8, 6, False, True),
                    Padding(5, 1, 8, 1, False, True)]
    assert manager.padding_for(make_step(CFG, [(0, 0, 30), (1, 0, 10)])) == Padding.unpadded(40, 2)  # above the ceiling


def test_step_is_frozen_and_validated():
    step = make_step(CFG, [(0, 0, 2)])
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.uniform_decode = True
    with pytest.raises(TypeError):
        step.inputs["input_ids"] = torch.zeros(2)
    with pytest.raises(ValueError, match="one token per request"):
        type(step)(num_tokens=2, num_seqs=1, inputs={}, uniform_decode=True)
    with pytest.raises(ValueError, match="num_seqs"):
        type(step)(num_tokens=2, num_seqs=3, inputs={})


def test_guard_off_skips_op_checks_but_still_refuses_step_reads():
    """guard_producers=False (for torch.compile'd producers) no longer checks ops for host
    syncs, but producer code reading the step is refused as before."""
    model, manager = toy_manager(CaptureConfig(enabled=True, debug_eager=True, max_tokens=32, guard_producers=False))
    orig = model.norm.forward
    model.norm.forward = lambda x: orig(x) * float(x.abs().max().item() > -1)  # a host sync: not checked now
    manager.run(make_step(CFG, [(0, 0, 4)]))
    model.norm.forward = lambda x: orig(x) + 0 * len(current_step().metadata.positions)
    with pytest.raises(RuntimeError, match="read by captured producer code"):
        manager.run(make_step(CFG, [(0, 0, 4)]))


@pytest.mark.parametrize("mode", ["none", "decode", "piecewise", "full_and_piecewise"])
def test_mode_decides_which_steps_take_graphs(mode):
    """Each capture mode routes decode and mixed steps as documented, and every route gives the
    plain-eager logits."""
    model, manager = toy_manager(CaptureConfig(mode=mode, debug_eager=True, max_tokens=32))
    g = torch.Generator().manual_seed(3)
    manager.run(make_step(CFG, [(0, 0, 4), (1, 0, 6), (3, 0, 2)], g))  # context for the decodes
    decode = make_step(CFG, [(0, 4, 1), (1, 6, 1), (3, 2, 1)], g)  # 3 rows: bucket 4 pads
    mixed = make_step(CFG, [(2, 0, 5), (0, 5, 1)], g)
    expect = {  # (decode: decode graph?, padded?), (mixed: padded?)
        "none": ((False, False), False),
        "decode": ((True, True), False),
        "piecewise": ((False, True), True),
        "full_and_piecewise": ((True, True), True),
    }[mode]
    pd, pm = manager.padding_for(decode), manager.padding_for(mixed)
    assert (pd.decode_graph, pd.rows > decode.num_tokens) == expect[0]
    assert (pm.rows > mixed.num_tokens) == expect[1]
    for step in (decode, mixed):
        k_before = model.k_cache.clone()
        out = manager.run(step)
        model.k_cache.copy_(k_before)
        torch.testing.assert_close(out, reference_logits(model, step), rtol=1e-5, atol=1e-5)
    eager_by_mode = {"none": 3, "decode": 2, "piecewise": 0, "full_and_piecewise": 0}[mode]
    assert manager.stats.eager_steps == eager_by_mode and manager.stats.fallbacks == 0


def test_keys_and_bucket_names():
    """Graph keys are GraphKeys in capture order; the previous release's bucket names warn."""
    _, manager = toy_manager(CaptureConfig(enabled=True, debug_eager=True, max_tokens=32, decode_buckets=(1, 2, 4)))
    keys = manager.keys()
    assert keys and all(isinstance(k, GraphKey) for k in keys)
    assert keys == sorted(keys, key=lambda k: (-k.rows, k.decode))  # largest first, piecewise before decode
    assert {k for k in keys if k.decode} == {GraphKey(b, True) for b in manager.decode_buckets}
    assert {k for k in keys if not k.decode} == {GraphKey(b, False) for b in manager.piecewise_buckets}
    assert manager.decode_buckets == (1, 2, 4) and manager.piecewise_buckets == (8, 12, 16, 24, 32)
    with pytest.warns(DeprecationWarning, match="CaptureManager.buckets is deprecated.*piecewise_buckets"):
        assert manager.buckets == manager.piecewise_buckets
    with pytest.warns(DeprecationWarning, match="CaptureManager.whole_buckets is deprecated.*decode_buckets"):
        assert manager.whole_buckets == manager.decode_buckets
    assert manager.graph(8) is None and manager.graph(GraphKey(4, True)) is None  # CPU: no graphs, ever
    assert len(manager.table) == 0 and GraphKey(8, False) not in manager.table and manager.failures == {}


def test_toy_source_dummy_steps_are_seeded_per_key_and_purpose():
    from graphcap import Purpose

    model = ToyTransformer(CFG)
    source = ToySource(model)
    for key in (GraphKey(4, True), GraphKey(12, False)):
        steps = {p: source.dummy_step(key, p) for p in Purpose}
        again = {p: source.dummy_step(key, p) for p in Purpose}
        for p in Purpose:
            assert steps[p].num_tokens == key.rows and steps[p].uniform_decode == key.decode
            assert torch.equal(steps[p].inputs["input_ids"], again[p].inputs["input_ids"])  # deterministic
        ids = [steps[p].inputs["input_ids"] for p in Purpose]
        assert not torch.equal(ids[0], ids[1]) and not torch.equal(ids[0], ids[2])  # each purpose its own data
    with pytest.raises(NotImplementedError, match="override dummy_step"):
        from graphcap import CaptureSource

        CaptureSource().dummy_step(GraphKey(4), Purpose.CAPTURE)


def test_capture_without_a_source_is_refused():
    model = ToyTransformer(CFG)
    manager = CaptureManager(model.forward, toy_static_inputs(CFG, "cpu"),
                             CaptureConfig(enabled=True, debug_eager=True, max_tokens=32))
    with pytest.raises(ValueError, match="needs a CaptureSource"):
        manager.capture()
