"""The suite's collection stays light: each of its pytest-xdist workers imports every test module, and
importing TensorFlow there cost each worker about 4 s of CPU for the few modules that use it. TensorFlow
and Keras are imported by the tests that use them (a fixture or an import in the test), never at a test
module's top."""

import ast
import glob
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HEAVY = ("tensorflow", "keras", "tf_keras", "horovod.tensorflow", "horovod.keras", "elastic_ext.tensorflow")


def top_level_imports(source):
    """The modules a source imports outside any function or class (under an ``if`` or ``try`` too)."""
    names, pending = [], list(ast.parse(source).body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
        elif isinstance(node, (ast.If, ast.Try, ast.ExceptHandler, ast.With)):
            pending.extend(ast.iter_child_nodes(node))
    return names


def heavy(names):
    return sorted(n for n in names if any(n == h or n.startswith(h + ".") for h in HEAVY))


def test_no_test_module_imports_tensorflow_at_its_top():
    modules = glob.glob(os.path.join(REPO, "tests", "**", "test_*.py"), recursive=True)
    modules += glob.glob(os.path.join(REPO, "tests", "**", "conftest.py"), recursive=True)
    assert len(modules) > 100, modules
    found = {os.path.relpath(m, REPO): heavy(top_level_imports(open(m).read())) for m in modules}
    assert not {m: names for m, names in found.items() if names}


def test_the_check_sees_imports_under_if_and_try_but_not_in_functions():
    source = ("import os\nif True:\n    import tensorflow as tf\ntry:\n    from keras import layers\n"
              "except ImportError:\n    import horovod.keras\ndef f():\n    import tf_keras\n")
    assert heavy(top_level_imports(source)) == ["horovod.keras", "keras", "tensorflow"]
