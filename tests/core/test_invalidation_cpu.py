"""Invalidation on CPU: after ``capture()`` the debug-eager path checks registered storage
before every step, exactly as replays do on a GPU (recapture counted, or a refusal)."""

import pytest
import torch

from graphcap import CaptureConfig, CaptureManager
from models.toy.bare import ToySource, ToyTransformer, make_step, toy_static_inputs
from models.toy.config import ToyConfig

CFG = ToyConfig(num_layers=2, hidden=32, num_heads=4, vocab=64, max_seqs=6, max_len=32, max_tokens=32)


def toy_manager(**config) -> tuple[ToyTransformer, CaptureManager]:
    torch.manual_seed(0)
    model = ToyTransformer(CFG)
    manager = CaptureManager(model.forward, toy_static_inputs(CFG, "cpu"),
                             CaptureConfig(enabled=True, debug_eager=True, max_tokens=32, **config), ToySource(model))
    manager.register("model", model)
    manager.register("kv_cache", model.cache_tensors, mutable=True)
    return model, manager


def test_reallocated_weight_recaptures_and_the_step_reads_the_new_weight():
    model, manager = toy_manager()
    manager.capture()
    step = make_step(CFG, [(0, 0, 3)], torch.Generator().manual_seed(1))
    before = manager.run(step).clone()
    model.lm_head.weight.data = torch.zeros_like(model.lm_head.weight)  # new storage
    out = manager.run(step)
    assert manager.stats.invalidations == 1 and manager.stats.recaptures == 1
    assert torch.count_nonzero(out) == 0 and torch.count_nonzero(before) > 0  # the new weight, not a stale one
    manager.run(step)
    assert manager.stats.invalidations == 1  # the recapture took a new snapshot


def test_moved_cache_and_reassigned_parameter_refused_when_recapture_is_off():
    model, manager = toy_manager(recapture_on_invalidation=False)
    manager.capture()
    step = make_step(CFG, [(0, 0, 3)])
    manager.run(step)
    model.k_cache = model.k_cache.clone()  # the cache moved
    with pytest.raises(RuntimeError, match="kv_cache.*recapture_on_invalidation is off"):
        manager.run(step)
    with pytest.raises(RuntimeError, match="stale"):
        manager.run(step)
    manager.capture()
    manager.run(step)
    model.norm.weight = torch.nn.Parameter(model.norm.weight.detach().clone())
    with pytest.raises(RuntimeError, match="reassigned"):
        manager.run(step)
    manager.registry.close()


def test_without_an_explicit_capture_cpu_steps_check_nothing():
    model, manager = toy_manager()
    step = make_step(CFG, [(0, 0, 3)])
    manager.run(step)
    model.lm_head.weight.data = torch.zeros_like(model.lm_head.weight)
    manager.run(step)
    assert manager.stats.invalidations == 0 and manager.stats.recaptures == 0
