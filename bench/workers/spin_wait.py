"""bench.engine's baseline worker: bench.compare's elastic_ext worker with Horovod's own collective wait.

Run by ``elastic-horovodrun`` like the worker itself, so that everything
else the launcher does stays. It takes back the one step of the launcher's
worker entry that bench.engine measures (:mod:`elastic_ext.worker.torch_wait`):
each wait for a collective spins in Horovod's extension again. Then it runs
bench/workers/compare_ext.py with the same arguments.
"""

import os
import runpy
import sys

from horovod.common import basics

init = basics.HorovodBasics.init
if not getattr(init, "elastic_ext_patches_wait", False):
    sys.exit("spin_wait.py: hvd.init() is not wrapped by elastic_ext.worker.torch_wait; "
             "run it under elastic-horovodrun")
basics.HorovodBasics.init = init.__wrapped__
script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compare_ext.py")
sys.argv = [script, *sys.argv[1:]]
runpy.run_path(script, run_name="__main__")
