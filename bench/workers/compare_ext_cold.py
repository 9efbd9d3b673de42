"""bench.compare's elastic_ext worker (compare_ext.py), started cold: system ``ext_cold``.

The launcher's worker entry gives a script that imports PyTorch the host's
spare (elastic_ext/launch/spare.py) and has the keeper import PyTorch
before its fork (elastic_ext/launch/keeper.py); both read the script's own
import statements. This file imports nothing the entry looks for and runs
compare_ext.py as ``__main__``, so every one of its workers imports PyTorch
itself as it starts, as every worker did before the spare: the baseline of
the spare's side-by-side in bench.compare (``--systems ext_cold,ext``).
"""

import os
import runpy

runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "compare_ext.py"), run_name="__main__")
