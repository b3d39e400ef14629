import dataclasses
import warnings

import pytest

from graphcap import CaptureConfig, Padding, bucket_for, bucket_list, default_buckets, padding, whole_graph_buckets


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
            assert padding(n, b) / b < 1 / 3 + 1e-9


def test_small_buckets_are_exact():
    assert default_buckets(512)[:4] == (1, 2, 4, 8)


def test_above_ceiling_is_none_and_bad_counts_raise():
    assert bucket_for(513, default_buckets(512)) is None
    with pytest.raises(ValueError, match="at least one token"):
        bucket_for(0, (1, 2))
    with pytest.raises(ValueError, match="do not fit"):
        padding(5, 4)


def test_explicit_buckets_are_used():
    cfg = CaptureConfig(max_tokens=64, buckets=(1, 3, 64))
    assert bucket_list(cfg) == (1, 3, 64)
    assert bucket_for(2, bucket_list(cfg)) == 3


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


def test_segmented_buckets_are_derived_above_the_whole_decode_graphs():
    """Uniform decode steps up to the request capacity replay whole graphs, so the derived
    segmented buckets start above the largest whole bucket; explicit buckets are kept."""
    cfg = CaptureConfig(max_tokens=1054)
    whole = whole_graph_buckets(cfg, 32)
    assert whole == (1, 2, 4, 8, 12, 16, 24, 32)
    seg = bucket_list(cfg, whole)
    assert seg == (48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1054)
    assert bucket_for(5, seg) == 48  # a short mixed step pads into the smallest segmented graph
    assert bucket_list(cfg) == default_buckets(1054)  # no whole graphs: every bucket segmented
    assert bucket_list(CaptureConfig(max_tokens=16), whole_graph_buckets(CaptureConfig(max_tokens=16), 32)) == (16,)
    explicit = CaptureConfig(max_tokens=64, buckets=(1, 3, 64))
    assert bucket_list(explicit, whole_graph_buckets(explicit, 8)) == (1, 3, 64)
    assert len(whole) + len(seg) == 19  # the 27 graphs for this config, before


def test_whole_graph_buckets_are_capped_by_request_capacity():
    cfg = CaptureConfig(max_tokens=64)
    assert whole_graph_buckets(cfg, 10) == (1, 2, 4, 8, 10)  # the capacity itself is a bucket
    assert whole_graph_buckets(CaptureConfig(max_tokens=64, decode_buckets=(1, 2, 4)), 10) == (1, 2, 4)
    with pytest.raises(ValueError, match="decode_buckets .*exceed the request capacity 10"):
        whole_graph_buckets(CaptureConfig(max_tokens=64, decode_buckets=(4, 16)), 10)
    assert whole_graph_buckets(CaptureConfig(max_tokens=64, mode="piecewise"), 10) == ()
    assert whole_graph_buckets(CaptureConfig(max_tokens=16, buckets=(3, 6, 16)), 6) == (3, 6)


def test_padding_is_one_decision_with_checked_invariants():
    seg = Padding.bucketed(9, 9, 12, whole_graph=False)  # a decode of 9 in a segmented bucket of 12
    assert (seg.rows, seg.request_rows, seg.padded) == (12, 9, True)
    whole = Padding.bucketed(3, 3, 4, whole_graph=True)
    assert (whole.rows, whole.request_rows) == (4, 4)
    assert not Padding.unpadded(5, 2).padded
    with pytest.raises(ValueError, match="one token per request"):
        Padding.bucketed(4, 2, 4, whole_graph=True)
    with pytest.raises(ValueError, match="below the real sizes"):
        Padding(5, 1, 4, 1)
    with pytest.raises(ValueError, match="positive int"):
        Padding(True, 1, 4, 1)


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


def test_from_env_names_the_variable_and_warns_on_typos(monkeypatch):
    monkeypatch.setenv("GRAPHCAP_BUCKETS", "1,two")
    with pytest.raises(ValueError, match="GRAPHCAP_BUCKETS='1,two' is not a comma-separated list of ints"):
        CaptureConfig.from_env()
    monkeypatch.delenv("GRAPHCAP_BUCKETS")
    monkeypatch.setenv("GRAPHCAP_MAX_TOKENS", "lots")
    with pytest.raises(ValueError, match="GRAPHCAP_MAX_TOKENS='lots' is not an int"):
        CaptureConfig.from_env()
    monkeypatch.setenv("GRAPHCAP_MAX_TOKENS", "0")
    with pytest.raises(ValueError, match="max_tokens.*GRAPHCAP_"):
        CaptureConfig.from_env()
    monkeypatch.delenv("GRAPHCAP_MAX_TOKENS")
    monkeypatch.setenv("GRAPHCAP_ENABLE", "1")
    with pytest.warns(UserWarning, match="GRAPHCAP_ENABLE is not a graphcap setting.*did you mean GRAPHCAP_ENABLED"):
        assert not CaptureConfig.from_env().enabled
    monkeypatch.delenv("GRAPHCAP_ENABLE")
    monkeypatch.setenv("GRAPHCAP_CACHE_DIR", "/tmp/x")  # a known non-field variable: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        CaptureConfig.from_env()


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
    whole = {m: whole_graph_buckets(CaptureConfig(mode=m, max_tokens=64), 8) for m in
             ("decode", "piecewise", "full_and_piecewise")}
    seg = {m: bucket_list(CaptureConfig(mode=m, max_tokens=64), whole[m]) for m in whole}
    assert whole["decode"] == whole["full_and_piecewise"] == (1, 2, 4, 8) and whole["piecewise"] == ()
    assert seg["decode"] == () and seg["piecewise"] == default_buckets(64)
    assert seg["full_and_piecewise"] == tuple(b for b in default_buckets(64) if b > 8)


def test_mode_from_env(monkeypatch):
    monkeypatch.setenv("GRAPHCAP_MODE", "piecewise")
    assert CaptureConfig.from_env().graph_mode == "piecewise"
    monkeypatch.setenv("GRAPHCAP_MODE", "fast")
    with pytest.raises(ValueError, match=r"CaptureConfig.mode .*GRAPHCAP_"):
        CaptureConfig.from_env()
