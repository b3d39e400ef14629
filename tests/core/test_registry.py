"""The stale-pointer guard on CPU tensors: what the registry snapshots, which changes it reports
(reallocated tensors, reassigned parameters and buffers, callables returning other tensors),
and what it ignores (in-place writes, other modules)."""

import pytest
import torch
from torch import nn

from graphcap.registry import StorageRegistry


def snapshot_of(**sources) -> StorageRegistry:
    reg = StorageRegistry()
    for name, (source, mutable) in sources.items():
        reg.add(name, source, mutable=mutable)
    reg.snapshot()
    return reg


def test_nothing_moved_after_a_snapshot_and_in_place_writes_are_not_moves():
    model, cache = nn.Linear(4, 4), {"k": torch.zeros(8)}
    reg = snapshot_of(model=(model, False), cache=(lambda: cache, True))
    assert reg.changed() is None and reg.changed(deep=True) is None
    with torch.no_grad():
        model.weight.mul_(2)  # same storage: graphs still read valid memory
    cache["k"].fill_(3)
    assert reg.changed() is None


def test_a_reallocated_parameter_is_named():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    reg = snapshot_of(model=(model, False))
    model[1].weight.data = torch.randn(2, 4)  # new storage under the same Parameter object
    assert reg.changed() == "model.1.weight was reallocated"


def test_a_reassigned_parameter_or_buffer_is_caught_by_the_registration_hook():
    model = nn.Linear(4, 4)
    model.register_buffer("scale", torch.ones(4))
    reg = snapshot_of(model=(model, False))
    model.weight = nn.Parameter(torch.randn(4, 4))
    assert reg.changed() == "model: Linear.weight was reassigned"
    reg.snapshot()  # a recapture takes the new object
    assert reg.changed() is None
    model.scale = torch.zeros(4)
    assert reg.changed() == "model: Linear.scale was reassigned"
    reg.close()


def test_other_modules_do_not_trip_the_hook():
    reg = snapshot_of(model=(nn.Linear(4, 4), False))
    other = nn.Linear(4, 4)
    other.weight = nn.Parameter(torch.randn(4, 4))
    assert reg.changed() is None
    reg.close()


def test_a_callable_source_is_reevaluated_and_names_what_moved():
    state = {"k": torch.zeros(8), "v": torch.zeros(8)}
    reg = snapshot_of(cache=(lambda: dict(state), True))
    state["v"] = torch.zeros(8)  # the cache swapped one tensor
    assert reg.changed() == "cache: v moved or changed"
    reg.snapshot()
    state["extra"] = torch.zeros(1)  # and a new one appeared
    assert reg.changed() == "cache: extra moved or changed"


def test_a_mapping_source_is_checked_only_deeply_after_reassignment():
    table = {"w": torch.zeros(4)}
    reg = snapshot_of(table=(table, False))
    table["w"].add_(1)
    assert reg.changed() is None
    table["w"] = torch.zeros(4)  # the mapping's entry was replaced: the snapshotted tensor did not move
    assert reg.changed() is None
    assert reg.changed(deep=True) == "table: w moved or changed"


def test_mutable_state_lists_only_mutable_sources_by_dotted_name():
    w, cache = torch.zeros(2), {"k": torch.zeros(3), "v": torch.zeros(3)}
    reg = snapshot_of(w=(w, False), cache=(lambda: cache, True), flag=(torch.zeros(1), True))
    state = reg.mutable_state()
    assert set(state) == {"cache.k", "cache.v", "flag"}
    assert state["cache.k"] is cache["k"]


def test_duplicate_and_unusable_sources_are_refused():
    reg = StorageRegistry()
    reg.add("a", torch.zeros(1))
    with pytest.raises(ValueError, match="already registered"):
        reg.add("a", torch.zeros(1))
    with pytest.raises(ValueError, match="expected a tensor, module, mapping or callable"):
        reg.add("b", 42)


def test_a_dropped_registry_frees_the_module_it_watched():
    """The reassignment hooks are global torch hooks: they must not keep a dropped registry, and
    through it the model, alive (a runner discarded without ``close()`` leaked its model). Its
    hooks are retired, and removed at the next registry's ``add``; a registry collected while
    torch iterates the hooks (a GC during a parameter registration) must not change them then
    (a first version removed them at once: "OrderedDict mutated during iteration" on the H200)."""
    import gc
    import weakref

    from torch.nn.modules import module as module_hooks

    hooks = module_hooks._global_parameter_registration_hooks
    StorageRegistry().add("warm", nn.Linear(2, 2))  # retire whatever earlier tests left
    gc.collect()
    StorageRegistry().add("warm", nn.Linear(2, 2))
    gc.collect()
    armed = []

    def collect_garbage(*args: object) -> None:  # a hook's return value would replace the parameter
        if armed:
            gc.collect()

    collect = module_hooks.register_module_parameter_registration_hook(collect_garbage)  # runs before ours
    try:
        m = nn.Linear(4, 4)
        reg = StorageRegistry()
        reg.add("model", m)
        before = len(hooks)
        m.weight = nn.Parameter(torch.zeros(4, 4))  # the hook still reports reassignment while alive
        assert "reassigned" in (reg.changed() or "")
        reg.cycle = reg  # only the cyclic collector frees it: inside the hook iteration below
        gone = weakref.ref(m)
        del m, reg
        armed.append(True)
        nn.Linear(3, 3)  # torch iterates the hooks; the collection runs before ours is reached
    finally:
        collect.remove()
    before -= 1  # the collecting hook
    assert gone() is None
    assert len(hooks) == before  # retired, not yet removed
    other = StorageRegistry()
    other.add("next", nn.Linear(2, 2))
    assert len(hooks) == before - 1 + 1  # the dead one removed, the new one added
    other.close()
