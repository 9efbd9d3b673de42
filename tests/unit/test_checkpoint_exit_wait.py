"""L6 of the security audit: at exit, a hung checkpoint write no longer holds a finished worker forever."""

import logging
import threading
import weakref

from elastic_ext.checkpoint import writer
from elastic_ext.checkpoint.writer import Checkpointer


def test_a_hung_write_is_abandoned_at_exit_after_the_bound_and_logged(monkeypatch, caplog):
    hung = threading.Event()  # the write (an upload that never answers) waits on it; set only after the test
    checkpointer = object.__new__(Checkpointer)  # no directory, no lock: only the write in flight matters here
    checkpointer._thread = threading.Thread(target=hung.wait, daemon=True)
    checkpointer._result_id = 42
    checkpointer._thread.start()
    monkeypatch.setattr(writer, "EXIT_WAIT_S", 0.2)
    try:
        with caplog.at_level(logging.INFO, logger=writer.__name__):
            writer._wait_at_exit(weakref.ref(checkpointer))  # before: joined the thread without a bound
        assert checkpointer._thread.is_alive()
        assert "the checkpoint of commit 42 did not finish within 0.2s of exit: abandoned" in caplog.text
    finally:
        hung.set()
