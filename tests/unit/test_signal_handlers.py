"""L4 of the security audit: the SIGTERM and SIGUSR1 (notice) handlers only ring a relay, so a signal that lands
while the main thread holds ``threading``'s locks (inside ``Thread.start``/``join``) cannot deadlock it."""

import subprocess
import sys

_CHILD = r"""
import os, signal, sys, threading
import elastic_ext
from elastic_ext.worker import notices, sigterm
from elastic_ext.liveness import Liveness

ROUNDS = int(sys.argv[1])

def churn_until(done):  # the main thread starts and joins threads: where a handler that did more used to deadlock
    while not done():
        thread = threading.Thread(target=int)
        thread.start()
        thread.join()

def hit(signum, live, held=None):
    if held is not None:  # the worst landing, made certain: the main thread holds the lock the old handler took
        with held:
            signal.raise_signal(signum)  # the handler runs now, on this thread, inside the block
    else:  # a landing anywhere in the churn
        sender = threading.Thread(target=os.kill, args=(os.getpid(), signum))
        sender.start()
        churn_until(live.leaving)
        sender.join()
    churn_until(live.leaving)

for i in range(ROUNDS):  # each round: a fresh worker's first SIGTERM asks it to leave, nothing else
    live = Liveness()
    previous = sigterm.install_sigterm(elastic_ext.ElasticConfig(term_grace_s=600.0), live)
    # Thread.start's lock (an RLock since Python 3.11, a Lock before: the old handler's Timer.start deadlocked there)
    hit(signal.SIGTERM, live, threading._active_limbo_lock if i % 2 else None)
    sigterm.restore_sigterm(previous)
for i in range(ROUNDS):  # the same for SIGUSR1, a preemption notice
    live = Liveness()
    notices._install_signal(elastic_ext.ElasticConfig(term_grace_s=600.0), live, {})
    # the lock Event.set takes: the old handler's act() deadlocked there (checked: the child hung)
    hit(signal.SIGUSR1, live, live._leaving._cond if i % 2 else None)
    assert live.leave_cause == "preemption"
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)
print("rounds", ROUNDS, flush=True)
live = Liveness()  # and the grace still ends a worker that reaches no commit
sigterm.install_sigterm(elastic_ext.ElasticConfig(term_grace_s=1.0), live)
hit(signal.SIGTERM, live)
churn_until(lambda: False)
"""


def test_signals_landing_while_the_main_thread_starts_and_joins_threads_never_deadlock_it():
    done = subprocess.run([sys.executable, "-c", _CHILD, "200"], capture_output=True, text=True, timeout=120)
    assert done.stdout.splitlines() == ["rounds 200"], done.stdout + done.stderr[-3000:]
    assert done.returncode == 143, done.stderr[-3000:]  # term_grace_s without a commit: the leave's exit code
    assert "no commit within term_grace_s (1s) after SIGTERM: exiting now" in done.stderr
