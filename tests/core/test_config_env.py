"""The one flag from the environment (``CaptureConfig.from_env``): every field, refusals that name
the variable (unparsable and out-of-range values alike), and warnings for names that are not
settings, lower case included."""

import warnings

import pytest

from graphcap import CaptureConfig


def test_every_kind_of_field_parses():
    c = CaptureConfig.from_env(environ={"GRAPHCAP_ENABLED": "yes", "GRAPHCAP_MAX_TOKENS": "256",
                                        "GRAPHCAP_BUCKETS": "8,64,256", "GRAPHCAP_AUDIT_EVERY": "1000",
                                        "GRAPHCAP_MODE": "piecewise", "GRAPHCAP_AUDIT_SEED": "3"})
    assert (c.enabled, c.max_tokens, c.buckets, c.audit_every, c.graph_mode, c.audit_seed) == (
        True, 256, (8, 64, 256), 1000, "piecewise", 3)


def test_the_base_is_kept_where_nothing_is_set():
    base = CaptureConfig(max_tokens=64, validate=True)
    assert CaptureConfig.from_env(base, environ={}) == base
    assert CaptureConfig.from_env(base, environ={"GRAPHCAP_VALIDATE": "0"}).validate is False


@pytest.mark.parametrize("env, match", [
    ({"GRAPHCAP_MAX_TOKENS": "0"}, r"max_tokens must be a positive int.*GRAPHCAP_MAX_TOKENS='0'"),
    ({"GRAPHCAP_AUDIT_EVERY": "-1"}, r"audit_every must be an int >= 0.*GRAPHCAP_AUDIT_EVERY='-1'"),
    ({"GRAPHCAP_MODE": "full_piecewise"}, r"did you mean 'full_and_piecewise'.*GRAPHCAP_MODE='full_piecewise'"),
    ({"GRAPHCAP_BUCKETS": "4,2"}, r"strictly increasing.*GRAPHCAP_BUCKETS='4,2'"),
    ({"GRAPHCAP_AUDIT_EVERY": "often"}, r"GRAPHCAP_AUDIT_EVERY='often' is not an int"),
    ({"GRAPHCAP_ENABLED": "maybe"}, r"GRAPHCAP_ENABLED='maybe' is not a boolean"),
])
def test_refusals_name_the_variable(env, match):
    with pytest.raises(ValueError, match=match):
        CaptureConfig.from_env(environ=env)


def test_a_value_refused_only_with_the_others_names_every_variable_set():
    base = CaptureConfig(max_tokens=2048)
    env = {"GRAPHCAP_BUCKETS": "1,1024", "GRAPHCAP_MAX_TOKENS": "512"}  # each alone is fine on this base
    with pytest.raises(ValueError, match=r"1024 above max_tokens=512") as e:
        CaptureConfig.from_env(base, environ=env)
    assert "GRAPHCAP_BUCKETS='1,1024'" in str(e.value) and "GRAPHCAP_MAX_TOKENS='512'" in str(e.value)
    assert CaptureConfig.from_env(base, environ={**env, "GRAPHCAP_MAX_TOKENS": "1024"}).buckets == (1, 1024)


def test_a_value_refused_on_its_own_names_its_variable_alone():
    with pytest.raises(ValueError, match=r"\(set through the environment: GRAPHCAP_BUCKETS='1,1024'\)$"):
        CaptureConfig.from_env(environ={"GRAPHCAP_BUCKETS": "1,1024", "GRAPHCAP_VALIDATE": "1"})


@pytest.mark.parametrize("var, hint", [
    ("graphcap_enabled", "variable names are upper case: GRAPHCAP_ENABLED"),
    ("Graphcap_Audit_Every", "variable names are upper case: GRAPHCAP_AUDIT_EVERY"),
    ("GRAPHCAP_MAX_TOKEN", "did you mean GRAPHCAP_MAX_TOKENS?"),
])
def test_names_that_are_no_setting_warn_with_the_fix(var, hint):
    with pytest.warns(UserWarning, match=f"{var} is not a graphcap setting and is ignored; {hint}"):
        c = CaptureConfig.from_env(environ={var: "1"})
    assert c == CaptureConfig()


def test_other_graphcap_variables_are_silent():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        CaptureConfig.from_env(environ={"GRAPHCAP_CACHE_DIR": "/tmp/x"})
