"""L5 of the security audit: the launcher's ssh checks host keys (Horovod's prefix says StrictHostKeyChecking=no)."""

import pytest

from elastic_ext.launch import ssh_keepalive
from tests.unit.horovod_restore import changes  # noqa: F401 - a fixture


@pytest.fixture
def horovod_prefix(monkeypatch):
    from horovod.runner.util import remote

    monkeypatch.setattr(remote, "SSH_COMMAND_PREFIX", "ssh -o PasswordAuthentication=no -o StrictHostKeyChecking=no")
    return remote


@pytest.mark.parametrize("env, option", [
    ({}, "StrictHostKeyChecking=accept-new"),
    ({"ELASTIC_EXT_SSH_HOST_KEYS": "accept-new"}, "StrictHostKeyChecking=accept-new"),
    ({"ELASTIC_EXT_SSH_HOST_KEYS": "strict"}, "StrictHostKeyChecking=yes"),
])
def test_the_prefix_after_install_holds_the_chosen_host_key_check(horovod_prefix, monkeypatch, env, option, changes):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    changes("ssh_keepalive")
    changes("ssh_keepalive")  # idempotent
    prefix = horovod_prefix.SSH_COMMAND_PREFIX
    assert "StrictHostKeyChecking=no" not in prefix
    assert prefix.count("StrictHostKeyChecking") == 1 and option in prefix.split()
    assert prefix.count(ssh_keepalive.OPTIONS) == 1 and "PasswordAuthentication=no" in prefix
