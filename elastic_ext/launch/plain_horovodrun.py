"""``python -m elastic_ext.launch.plain_horovodrun ARGS``: ``horovodrun ARGS`` with Horovod's build checks
answered from the launcher's cache, for the tests of elastic_ext under plain Horovod.

Everything else is the ``horovodrun`` script's: Horovod's own argument
parsing, runner and elastic driver (``horovod.runner.launch.run_commandline``),
none of the launcher's changes. The one difference: before it starts the
first worker, ``horovodrun`` asks whether Horovod was built with Gloo (an
elastic job) or MPI, by importing TensorFlow in a forked process, about 3 s
of a core for the same answer every time; here
:mod:`elastic_ext.launch.build_check` gives Horovod's own answer from its
cache. Tests launch their plain-Horovod jobs through this
(:data:`devkit.launch.RUNNER`); the tests of Horovod's own
elastic scenarios and of the Slurm-driven job run the ``horovodrun`` script
itself.
"""

import sys


def main() -> None:
    # Imported here, not at the top: Horovod's runner starts each command (a discovery run every second,
    # each worker) through a "spawn" multiprocessing child, which imports this module first.
    from elastic_ext.launch import horovod_changes
    horovod_changes.install_launcher(parts=("build_check",))
    from horovod.runner.launch import run_commandline
    sys.argv = ["horovodrun", *sys.argv[1:]]
    sys.exit(run_commandline())


if __name__ == "__main__":
    main()
