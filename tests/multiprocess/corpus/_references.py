"""Several corpus scripts' one-process references (``--reference``) in one process, one after the other.

Each reference is the script itself, run as ``__main__`` with its own
``sys.argv`` (``runpy``), as ``python SCRIPT ARGS...`` runs it; what differs
from a process of its own is only that torch and Horovod are imported once
for all of them (about 3.4 s of a core each, the most of a reference's
cost). The PyTorch scripts change no global setting but the thread count,
which each sets to 1. Keras names its variables by a process-wide counter,
so the TensorFlow scripts keep a process each.

    python _references.py PLAN.json

PLAN: a JSON list of ``[script, [argument, ...], status_file]``. Each
script's outcome goes to its status file: ``{"ok": true}`` or ``{"ok":
false, "error": traceback}``; one that fails does not stop the others.
"""

import json
import os
import runpy
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))


def main(plan_path):
    with open(plan_path) as handle:
        plan = json.load(handle)
    sys.path.insert(0, HERE)  # as for ``python SCRIPT``: the script's directory first (its ``_hooks``)
    for script, arguments, status_file in plan:
        sys.argv = [script, *arguments]
        try:
            runpy.run_path(script, run_name="__main__")
            status = {"ok": True}
        except SystemExit as exc:  # as the script's own process would have ended
            status = {"ok": exc.code in (0, None), "error": f"SystemExit({exc.code!r})"}
        except BaseException:  # noqa: B902 - its outcome, then the next one
            status = {"ok": False, "error": traceback.format_exc()}
        with open(status_file, "w") as handle:
            json.dump(status, handle)
        print(f"reference {os.path.basename(script)}: {'ok' if status['ok'] else 'failed'}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python _references.py PLAN.json")
    main(sys.argv[1])
