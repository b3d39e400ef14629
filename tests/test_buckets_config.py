import pytest

from graphcap import CaptureConfig, bucket_for, bucket_list, default_buckets, padding


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
        (dict(full_graph_max_tokens=0), "full_graph_max_tokens"),
    ],
)
def test_invalid_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        CaptureConfig(**kwargs)


def test_config_is_frozen():
    cfg = CaptureConfig()
    with pytest.raises(Exception):
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
