"""Makes the discovery scripts next to it import the elastic_ext of this checkout.

horovodrun runs ``host_discovery/*.py`` as executables, with whatever
``python3`` comes first on PATH: elastic_ext may not be installed there, or
installed as an older copy. The checkout these scripts sit in wins. This
directory then leaves ``sys.path``, so that its file names (``slurm``,
``static``) shadow no module. Installed packages use the
``elastic-ext-discover-*`` commands instead (setup.py).
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
if os.path.isfile(os.path.join(_ROOT, "elastic_ext", "__init__.py")):
    sys.path.insert(0, _ROOT)
