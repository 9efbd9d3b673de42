import pytest

from elastic_ext.config import ElasticConfig
from elastic_ext.errors import ConfigError


def test_argument_beats_environment_beats_default():
    env = {"ELASTIC_EXT_ROLLBACK_LIMIT": "9", "ELASTIC_EXT_EVENTS_PATH": "/tmp/e.jsonl"}
    assert ElasticConfig.from_env(env).rollback_limit == 9
    assert ElasticConfig.from_env(env).events_path == "/tmp/e.jsonl"
    assert ElasticConfig.from_env(env, rollback_limit=2).rollback_limit == 2
    assert ElasticConfig.from_env({}).rollback_limit == ElasticConfig().rollback_limit


@pytest.mark.parametrize("env, message", [
    ({"ELASTIC_EXT_ROLLBACK_LIMIT": "many"}, r"ELASTIC_EXT_ROLLBACK_LIMIT \('many'\) must be an integer"),
    ({"ELASTIC_EXT_ROLLBACK_LIMIT": "-1"}, r"rollback_limit \(-1\) must be an integer >= 0"),
    ({"ELASTIC_EXT_COMMIT_BUFFERS": "3"}, r"commit_buffers \(3\) must be 1 or 2"),
    ({"ELASTIC_EXT_STALL_TIMEOUT_S": "soon"}, r"ELASTIC_EXT_STALL_TIMEOUT_S \('soon'\) must be a number"),
    ({"ELASTIC_EXT_HANG_TIMEOUT_S": "1"}, r"hang_timeout_s \(1.0\) must be 0 \(off\) or at least 2.0"),
    # L6 (audit): 1e-9 was accepted and Gloo silently waited 1 s
    ({"ELASTIC_EXT_COLLECTIVE_TIMEOUT_S": "1e-9"}, r"collective_timeout_s \(1e-09\) must be 0 .* or at least 1.0"),
    ({"ELASTIC_EXT_RENDEZVOUS_TIMEOUT_S": "0.5"}, r"rendezvous_timeout_s \(0.5\) must be 0 .* or at least 1.0"),
    ({"ELASTIC_EXT_SSH_HOST_KEYS": "no"}, r"ssh_host_keys \('no'\) must be one of \['accept-new', 'strict'\]"),
])
def test_bad_values_are_named(env, message):
    with pytest.raises(ConfigError, match=message):
        ElasticConfig.from_env(env)


def test_unknown_override_is_rejected():
    with pytest.raises(ConfigError, match="unknown ElasticConfig fields"):
        ElasticConfig.from_env({}, rollbak_limit=1)


def test_a_variable_of_a_setting_that_does_not_exist_is_named(monkeypatch):
    """A removed setting (or a typo) in the environment is not silently ignored."""
    with pytest.raises(ConfigError, match=r"ELASTIC_EXT_OVERLAP_COMMIT is not a setting"):
        ElasticConfig.from_env({"ELASTIC_EXT_OVERLAP_COMMIT": "1"})
