"""elastic_ext.control.horovod_seam: the launcher and the worker entry stop on a Horovod that differs.

Each case fakes one difference in this process (the version, or one
attribute the project replaces, removed with monkeypatch) and runs the real
entry points: ``elastic-horovodrun``'s ``main`` and the worker entry's
``main``. Each must stop with one message that names the difference, before
anything of Horovod is changed or the script runs.
"""

import horovod
import pytest
from horovod.common.basics import HorovodBasics
from horovod.runner.elastic.driver import ElasticDriver

from elastic_ext.control import horovod_seam
from elastic_ext.launch import horovodrun
from elastic_ext.worker import entry as worker

EVERY_ROW = (*horovod_seam.LAUNCHER, *horovod_seam.WORKER, *horovod_seam.WORKER_ELASTIC)


def launcher_stops():
    """Runs elastic-horovodrun's main; returns its exit message (it must exit before changing Horovod)."""
    from horovod.runner import gloo_run
    with pytest.raises(SystemExit) as stopped:
        horovodrun.main(["-np", "1", "python", "-c", "pass"])
    assert not horovod_seam.REPLACED, "Horovod was changed before the check"
    assert gloo_run.ElasticDriver is ElasticDriver
    message = str(stopped.value.code)
    assert message.startswith("elastic-horovodrun: this Horovod differs"), message
    return message


def worker_stops(tmp_path):
    """Runs the worker entry on a script that would leave a file; returns its exit message (the script never ran)."""
    ran = tmp_path / "ran"
    script = tmp_path / "script.py"
    script.write_text(f"open({str(ran)!r}, 'w').close()\n")
    with pytest.raises(SystemExit) as stopped:
        worker.main([str(script)])
    assert not ran.exists(), "the script ran despite the check"
    assert not horovod_seam.REPLACED, "Horovod was changed before the check"
    message = str(stopped.value.code)
    assert message.startswith("elastic_ext worker: this Horovod differs"), message
    return message


def test_the_installed_horovod_passes_every_check():
    assert horovod.__version__ == horovod_seam.EXPECTED_VERSION
    assert horovod_seam.differences(EVERY_ROW) == []
    horovod_seam.check_launcher()
    horovod_seam.check_worker(elastic=True)
    horovod_seam.check_worker(elastic=False)


def test_another_version_stops_the_launcher_and_the_worker_entry(monkeypatch, tmp_path):
    monkeypatch.setattr(horovod, "__version__", "0.28.2")
    for message in (launcher_stops(), worker_stops(tmp_path)):
        assert "Horovod version: expected 0.28.1, found 0.28.2" in message, message
        assert "pip install horovod==0.28.1" in message, message  # what to do


def test_a_missing_overridden_driver_method_stops_the_launcher(monkeypatch):
    monkeypatch.delattr(ElasticDriver, "_update_host_assignments")
    message = launcher_stops()
    assert "horovod.runner.elastic.driver.ElasticDriver._update_host_assignments (overridden): expected, not found" \
        in message, message
    assert "1 place(s)" in message, message


def test_a_missing_wrapped_basics_query_stops_the_launcher_and_the_worker_entry(monkeypatch, tmp_path):
    monkeypatch.delattr(HorovodBasics, "local_size")
    for message in (launcher_stops(), worker_stops(tmp_path)):
        assert "horovod.common.basics.HorovodBasics.local_size (replaced): expected, not found" in message, message


def test_a_missing_instance_field_is_found_from_the_class_source(monkeypatch):
    """Fields Horovod sets in __init__ are not class attributes: the check reads ``self.NAME =`` in the source."""
    row = ("horovod.runner.elastic.driver", "ElasticDriver._worker_registry", "instance")
    assert horovod_seam.missing([row]) == []
    gone = ("horovod.runner.elastic.driver", "ElasticDriver._no_such_field", "instance")
    assert horovod_seam.missing([gone]) == [
        "horovod.runner.elastic.driver.ElasticDriver._no_such_field (instance): expected, not found "
        "(horovod.runner.elastic.driver.ElasticDriver has no attribute '_no_such_field')"]


def test_build_patches_reads_what_the_setup_recorded_and_refuses_anything_else(monkeypatch):
    import sys
    import types

    monkeypatch.setitem(sys.modules, "horovod.elastic_ext_patches", None)  # a Horovod built elsewhere
    assert horovod_seam.build_patches() == ()
    recorded = types.ModuleType("horovod.elastic_ext_patches")
    recorded.PATCHES = ("01-python312-distutils", horovod_seam.TUNING_FIX)
    monkeypatch.setitem(sys.modules, "horovod.elastic_ext_patches", recorded)
    assert horovod_seam.build_patches() == ("01-python312-distutils", horovod_seam.TUNING_FIX)
    recorded.PATCHES = "07-fixed-tuning-after-reset"  # a string, not a tuple of names
    with pytest.raises(horovod_seam.ConfigError, match="expected a tuple of patch names"):
        horovod_seam.build_patches()
