"""The test cluster's state directory is root's alone (audit M6): root runs its bin/ssh, sshd trusts its keys.

Building the cluster needs root and namespaces (tests/multihost); here the
checks that guard it refuse what a local user could plant or reach.
"""

import os
import subprocess
import sys

import pytest

from tools import testcluster
from tools.testcluster import ClusterError, check_private, private_dir

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_state_directory_under_a_world_writable_one_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)  # what /tmp is: where the old fixed STATE lived
    with pytest.raises(ClusterError, match=f"{shared}: mode 1777 lets others write"):
        private_dir(str(shared / "state"))


def test_a_planted_state_directory_is_refused(tmp_path):
    elsewhere = tmp_path / "theirs"
    elsewhere.mkdir()
    planted = tmp_path / "state"
    os.symlink(elsewhere, planted)  # made by someone between down() and up()
    with pytest.raises(ClusterError, match="exists after down removed it"):
        private_dir(str(planted))
    with pytest.raises(ClusterError, match="not a directory"):
        check_private(str(planted))
    os.mkdir(tmp_path / "open", 0o755)
    os.chmod(tmp_path / "open", 0o755)
    with pytest.raises(ClusterError, match="lets others in"):
        check_private(str(tmp_path / "open"))


def test_the_state_directory_is_no_longer_in_tmp_and_the_tool_still_starts():
    assert not testcluster.STATE.startswith("/tmp/")
    done = subprocess.run([sys.executable, os.path.join(REPO, "tools", "testcluster.py"), "--help"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "status" in done.stdout
