import dataclasses
import warnings

import pytest

import graphcap
from graphcap import (
    CaptureConfig,
    GraphKey,
    Padding,
    bucket_for,
    decode_graph_buckets,
    default_buckets,
    padded_rows,
    piecewise_graph_buckets,
)
from graphcap.buckets import eager_warmup_buckets


@pytest.mark.parametrize("ceiling", [1, 7, 8, 100, 512, 4096])
def test_default_buckets_cover_every_count_with_bounded_waste(ceiling):
    buckets = default_buckets(ceiling)
    assert buckets[0] == 1 and buckets[-1] == ceiling
    assert list(buckets) == sorted(set(buckets))
    for n in range(1, ceiling + 1):
        b = bucket_for(n, buckets)
        assert b is not None and b >= n
        assert bucket_for(n, buckets) == min(x for x in buckets if x >= n)
        if n > 8:
            assert padded_rows(n, b) / b < 1 / 3 + 1e-9


def test_small_buckets_are_exact():
    assert default_buckets(512)[:4] == (1, 2, 4, 8)


def test_above_ceiling_is_none_and_bad_counts_raise():
    assert bucket_for(513, default_buckets(512)) is None
    with pytest.raises(ValueError, match="at least one token"):
        bucket_for(0, (1, 2))
    with pytest.raises(ValueError, match="do not fit"):
        padded_rows(5, 4)


def test_explicit_buckets_are_used():
    cfg = CaptureConfig(max_tokens=64, buckets=(1, 3, 64))
    assert piecewise_graph_buckets(cfg) == (1, 3, 64)
    assert bucket_for(2, piecewise_graph_buckets(cfg)) == 3


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(warmup_steps=0), "warmup_steps"),
        (dict(buckets=()), "buckets"),
        (dict(buckets=(4, 2)), "buckets"),
        (dict(buckets=(1, 1)), "buckets"),
        (dict(buckets=(0, 2)), "buckets"),
        (dict(max_tokens=8, buckets=(1, 16)), "buckets"),
        (dict(enabled="yes"), "enabled"),
        (dict(validate=1), "validate"),
        (dict(decode_buckets=(0, 2)), "decode_buckets"),
        (dict(max_tokens=8, decode_buckets=(1, 16)), "decode_buckets"),
        (dict(detect_frozen=1), "detect_frozen"),
        (dict(max_tokens=True), "max_tokens"),
        (dict(warmup_steps=True), "warmup_steps"),
        (dict(decode_buckets=(True,)), "decode_buckets"),
        (dict(buckets=(1, True)), "buckets"),
        (dict(buckets="1,2"), "buckets"),
        (dict(buckets=(1, 2.0)), "buckets"),
    ],
)
def test_invalid_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        CaptureConfig(**kwargs)


def test_buckets_accept_any_iterable_of_ints():
    assert CaptureConfig(max_tokens=8, buckets=range(1, 9, 3)).buckets == (1, 4, 7)
    assert CaptureConfig(max_tokens=8, buckets=[1, 8]).buckets == (1, 8)
    assert CaptureConfig(max_tokens=8, buckets=(b for b in (2, 4))).buckets == (2, 4)


def test_piecewise_buckets_are_derived_above_the_decode_graphs():
    """Uniform decode steps up to the request capacity replay decode graphs, so the derived
    piecewise buckets start above the largest decode bucket; explicit buckets are kept."""
    cfg = CaptureConfig(max_tokens=1054)
    decode = decode_graph_buckets(cfg, 32)
    assert decode == (1, 2, 4, 8, 12, 16, 24, 32)
    piecewise = piecewise_graph_buckets(cfg, decode)
    assert piecewise == (48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1054)
    assert bucket_for(5, piecewise) == 48  # a short mixed step pads into the smallest piecewise graph
    assert piecewise_graph_buckets(cfg) == default_buckets(1054)  # no decode graphs: every bucket piecewise
    small = CaptureConfig(max_tokens=16)
    assert piecewise_graph_buckets(small, decode_graph_buckets(small, 32)) == (16,)
    explicit = CaptureConfig(max_tokens=64, buckets=(1, 3, 64))
    assert piecewise_graph_buckets(explicit, decode_graph_buckets(explicit, 8)) == (1, 3, 64)
    assert len(decode) + len(piecewise) == 19  # the 27 graphs for this config, before


def test_decode_graph_buckets_are_capped_by_request_capacity():
    cfg = CaptureConfig(max_tokens=64)
    assert decode_graph_buckets(cfg, 10) == (1, 2, 4, 8, 10)  # the capacity itself is a bucket
    assert decode_graph_buckets(CaptureConfig(max_tokens=64, decode_buckets=(1, 2, 4)), 10) == (1, 2, 4)
    with pytest.raises(ValueError, match="decode_buckets .*exceed the request capacity 10"):
        decode_graph_buckets(CaptureConfig(max_tokens=64, decode_buckets=(4, 16)), 10)
    assert decode_graph_buckets(CaptureConfig(max_tokens=64, mode="piecewise"), 10) == ()
    assert decode_graph_buckets(CaptureConfig(max_tokens=16, buckets=(3, 6, 16)), 6) == (3, 6)


def test_old_bucket_function_names_warn_and_return_the_new_functions():
    """The previous release's spellings still resolve, with a DeprecationWarning naming the new one."""
    renamed = {"whole_graph_buckets": decode_graph_buckets, "bucket_list": piecewise_graph_buckets,
               "padding": padded_rows}
    for old, new in renamed.items():
        with pytest.warns(DeprecationWarning, match=f"graphcap.{old} is deprecated.*use graphcap.{new.__name__}"):
            assert getattr(graphcap, old) is new
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        graphcap.no_such_name  # noqa: B018


def test_graph_keys_name_rows_and_kind():
    decode, piecewise = GraphKey(64, True), GraphKey(64, decode=False)
    assert (str(decode), str(piecewise)) == ("64 decode", "64 piecewise")
    assert (decode.kind, piecewise.kind) == ("decode", "piecewise") and GraphKey(8).kind == "piecewise"
    rows, is_decode = decode  # a NamedTuple: (rows, decode) unpacking still works
    assert (rows, is_decode) == (64, True) and decode == (64, True) and decode != piecewise


def test_padding_is_one_decision_with_checked_invariants():
    piecewise = Padding.for_graph(9, 9, GraphKey(12, False))  # a decode of 9 in a piecewise bucket of 12
    assert (piecewise.rows, piecewise.request_rows, piecewise.padded) == (12, 9, True)
    assert not piecewise.decode_graph and piecewise.graph_size
    decode = Padding.for_graph(3, 3, GraphKey(4, True))
    assert (decode.rows, decode.request_rows, decode.decode_graph, decode.graph_size) == (4, 4, True, True)
    assert not Padding.unpadded(5, 2).padded and not Padding.unpadded(5, 2).graph_size
    assert Padding.unpadded(5, 2, graph_size=True) == Padding(5, 2, 5, 2, False, True)
    with pytest.raises(ValueError, match="one token per request"):
        Padding.for_graph(4, 2, GraphKey(4, True))
    with pytest.raises(ValueError, match="below the real sizes"):
        Padding(5, 1, 4, 1)
    with pytest.raises(ValueError, match="positive int"):
        Padding(True, 1, 4, 1)


def test_old_padding_spellings_warn():
    with pytest.warns(DeprecationWarning, match="Padding.whole_graph is deprecated.*Padding.decode_graph"):
        assert Padding.for_graph(3, 3, GraphKey(4, True)).whole_graph is True
    with pytest.warns(DeprecationWarning, match="Padding.bucketed is deprecated"):
        assert Padding.bucketed(3, 3, 4, whole_graph=True) == Padding.for_graph(3, 3, GraphKey(4, True))


def test_config_is_frozen():
    cfg = CaptureConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.enabled = True


def test_from_env(monkeypatch):
    monkeypatch.setenv("GRAPHCAP_ENABLED", "1")
    monkeypatch.setenv("GRAPHCAP_BUCKETS", "1,2,32")
    monkeypatch.setenv("GRAPHCAP_MAX_TOKENS", "32")
    cfg = CaptureConfig.from_env()
    assert cfg.enabled and cfg.buckets == (1, 2, 32) and cfg.max_tokens == 32
    monkeypatch.setenv("GRAPHCAP_VALIDATE", "maybe")
    with pytest.raises(ValueError, match="GRAPHCAP_VALIDATE"):
        CaptureConfig.from_env()


def test_from_env_names_the_variable_and_warns_on_typos():
    with pytest.raises(ValueError, match="GRAPHCAP_BUCKETS='1,two' is not a comma-separated list of ints"):
        CaptureConfig.from_env(environ={"GRAPHCAP_BUCKETS": "1,two"})
    with pytest.raises(ValueError, match="GRAPHCAP_MAX_TOKENS='lots' is not an int"):
        CaptureConfig.from_env(environ={"GRAPHCAP_MAX_TOKENS": "lots"})
    with pytest.raises(ValueError, match=r"max_tokens.*\(set through the environment: GRAPHCAP_MAX_TOKENS='0'\)"):
        CaptureConfig.from_env(environ={"GRAPHCAP_MAX_TOKENS": "0"})
    with pytest.warns(UserWarning, match="GRAPHCAP_ENABLE is not a graphcap setting.*did you mean GRAPHCAP_ENABLED"):
        assert not CaptureConfig.from_env(environ={"GRAPHCAP_ENABLE": "1"}).enabled
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a known non-field variable: no warning
        CaptureConfig.from_env(environ={"GRAPHCAP_CACHE_DIR": "/tmp/x"})


def test_mode_properties_and_audit_fields():
    for mode, decode, piecewise in [("none", False, False), ("decode", True, False), ("piecewise", False, True),
                                    ("full_and_piecewise", True, True)]:
        cfg = CaptureConfig(mode=mode)
        assert (cfg.decode_graphs, cfg.piecewise_graphs) == (decode, piecewise)
    assert (CaptureConfig().audit_every, CaptureConfig().audit_seed) == (0, 0)
    for field, bad in [("audit_every", -1), ("audit_every", True), ("audit_seed", -2), ("audit_seed", 1.0)]:
        with pytest.raises(ValueError, match=f"CaptureConfig.{field}"):
            CaptureConfig(**{field: bad})


def test_mode_resolves_from_enabled_and_refuses_bad_values():
    assert CaptureConfig().graph_mode == "none" and not CaptureConfig().captures
    assert CaptureConfig(enabled=True).graph_mode == "full_and_piecewise"
    assert CaptureConfig(mode="decode").graph_mode == "decode"  # an explicit mode decides alone
    with pytest.raises(ValueError, match=r"CaptureConfig.mode must be one of .*did you mean 'piecewise'"):
        CaptureConfig(mode="piecewize")
    with pytest.raises(ValueError, match="contradicts itself"):
        CaptureConfig(enabled=True, mode="none")
    with pytest.raises(ValueError, match="CaptureConfig.mode"):
        CaptureConfig(mode=True)


def test_mode_picks_the_bucket_sets():
    decode = {m: decode_graph_buckets(CaptureConfig(mode=m, max_tokens=64), 8) for m in
              ("decode", "piecewise", "full_and_piecewise")}
    piecewise = {m: piecewise_graph_buckets(CaptureConfig(mode=m, max_tokens=64), decode[m]) for m in decode}
    assert decode["decode"] == decode["full_and_piecewise"] == (1, 2, 4, 8) and decode["piecewise"] == ()
    assert piecewise["decode"] == () and piecewise["piecewise"] == default_buckets(64)
    assert piecewise["full_and_piecewise"] == tuple(b for b in default_buckets(64) if b > 8)


def test_mode_decode_warms_its_eager_step_sizes():
    """Mode decode runs every other step eagerly: the sizes a piecewise graph would have had are
    warmed before capture returns (at least the ceiling, for the chunk kernels); the other
    modes pad those steps into piecewise graphs and warm nothing extra."""
    decode = decode_graph_buckets(CaptureConfig(mode="decode", max_tokens=64), 8)
    assert eager_warmup_buckets(CaptureConfig(mode="decode", max_tokens=64), decode) == (12, 16, 24, 32, 48, 64)
    assert eager_warmup_buckets(CaptureConfig(mode="decode", max_tokens=8), (1, 2, 4, 8)) == (8,)
    for mode in ("none", "piecewise", "full_and_piecewise"):
        assert eager_warmup_buckets(CaptureConfig(mode=mode, max_tokens=64), decode) == ()


def test_mode_from_env():
    assert CaptureConfig.from_env(environ={"GRAPHCAP_MODE": "piecewise"}).graph_mode == "piecewise"
    with pytest.raises(ValueError, match=r"CaptureConfig.mode .*GRAPHCAP_MODE='fast'"):
        CaptureConfig.from_env(environ={"GRAPHCAP_MODE": "fast"})
