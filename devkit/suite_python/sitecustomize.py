"""The test suite's interpreter setting, in every Python process the suite starts.

``tests/conftest.py`` puts this directory on ``PYTHONPATH``, so Python's
``site`` imports this module when each of the suite's processes starts (the
workers, launchers, discovery runs and helpers of its jobs). It changes
when the garbage collector runs, nothing else:

- The first generation is collected after 20,000 new container objects
  instead of 700. Importing torch and building a first optimizer (which
  imports ``torch._dynamo``) allocates millions of objects, and at 700
  the collector ran over them hundreds of times: about 0.5 s of a core per
  PyTorch process on this machine.
- At exit, after every other ``atexit`` handler (this one is registered
  first, so it runs last), the objects still alive are frozen
  (``gc.freeze``): the interpreter's teardown frees them by reference
  count as before, and its full collections skip them; those collections
  over torch's and ``torch._dynamo``'s objects took about 0.9 s of a core
  per process. A frozen object in a reference cycle is not finalized at
  exit (the kernel reclaims its memory, closes its descriptors).

Measured in ``docs/testing.md``. Benchmarks do not use it (``bench/``
launches without this directory): they measure what users run.
"""

import atexit
import gc

gc.set_threshold(20000, 10, 10)
atexit.register(gc.freeze)
