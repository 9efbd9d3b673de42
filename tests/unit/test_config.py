import pytest

from elastic_ext.config import ElasticConfig
from elastic_ext.errors import ConfigError


def test_argument_beats_environment_beats_default():
    env = {"ELASTIC_EXT_ROLLBACK_LIMIT": "9", "ELASTIC_EXT_VERIFY_SYNC": "off"}
    assert ElasticConfig.from_env(env).rollback_limit == 9
    assert ElasticConfig.from_env(env).verify_sync is False
    assert ElasticConfig.from_env(env, rollback_limit=2).rollback_limit == 2
    assert ElasticConfig.from_env({}).rollback_limit == ElasticConfig().rollback_limit


@pytest.mark.parametrize("env, message", [
    ({"ELASTIC_EXT_ROLLBACK_LIMIT": "many"}, r"ELASTIC_EXT_ROLLBACK_LIMIT \('many'\) must be an integer"),
    ({"ELASTIC_EXT_ROLLBACK_LIMIT": "-1"}, r"rollback_limit \(-1\) must be an integer >= 0"),
    ({"ELASTIC_EXT_COMMIT_BUFFERS": "3"}, r"commit_buffers \(3\) must be 1 or 2"),
    ({"ELASTIC_EXT_VERIFY_SYNC": "maybe"}, r"ELASTIC_EXT_VERIFY_SYNC \('maybe'\) must be one of"),
])
def test_bad_values_are_named(env, message):
    with pytest.raises(ConfigError, match=message):
        ElasticConfig.from_env(env)


def test_unknown_override_is_rejected():
    with pytest.raises(ConfigError, match="unknown ElasticConfig fields"):
        ElasticConfig.from_env({}, rollbak_limit=1)


def test_first_step_timeout_comes_from_the_environment_and_is_validated():
    assert ElasticConfig.from_env({"ELASTIC_EXT_FIRST_STEP_TIMEOUT_S": "90"}).first_step_timeout_s == 90.0
    assert ElasticConfig().first_step_timeout_s > ElasticConfig().stall_timeout_s
    with pytest.raises(ConfigError, match=r"first_step_timeout_s \(-1.0\) must be a finite number >= 0"):
        ElasticConfig.from_env({"ELASTIC_EXT_FIRST_STEP_TIMEOUT_S": "-1"})
