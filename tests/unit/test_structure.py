"""The package's import structure: no circle, and a framework-free core.

The graph is read from the source, not from a running import, so an import
inside a function counts as much as one at the top of a module: a circle
through a function-level import is still two modules that cannot be
understood (or moved) one without the other. Imports under
``if TYPE_CHECKING:`` never run and are left out. Importing ``a.b.c`` also
runs the ``__init__`` of ``a`` and ``a.b``; those implicit edges are left out
too, since every submodule would otherwise close a circle with its package.
"""

import ast
import os
import subprocess
import sys
from typing import Dict, List, Optional, Set

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = "elastic_ext"
FRAMEWORK_PACKAGES = ("elastic_ext.torch", "elastic_ext.tensorflow")


def module_files() -> Dict[str, str]:
    """Every module of the package by dotted name (a package by its own name)."""
    found = {}
    root = os.path.join(REPO, PACKAGE)
    for top, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(names):
            if not name.endswith(".py"):
                continue
            parts = os.path.relpath(os.path.join(top, name), REPO)[:-3].split(os.sep)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = os.path.join(top, name)
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST) -> List[ast.stmt]:
    """Every import statement at any depth, except under ``if TYPE_CHECKING:``."""
    found: List[ast.stmt] = []
    pending = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        children = list(ast.iter_child_nodes(node))
        if isinstance(node, ast.If) and _is_type_checking(node):
            children = list(node.orelse)
        pending.extend(children)
    return found


def _known(name: str, modules: Set[str]) -> Optional[str]:
    """The module that ``import name`` runs last: the longest known prefix."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def import_graph() -> Dict[str, Set[str]]:
    """Module -> the package modules it imports (top-level or inside functions)."""
    files = module_files()
    modules = set(files)
    graph: Dict[str, Set[str]] = {}
    for module, path in files.items():
        with open(path, encoding="utf-8") as handle:
            tree = ast.parse(handle.read(), path)
        is_package = path.endswith("__init__.py")
        targets: Set[str] = set()
        for node in _import_nodes(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = module.split(".")
                    anchor = anchor[:len(anchor) - node.level + (1 if is_package else 0)]
                    base = ".".join(anchor + ([base] if base else []))
                # ``from pkg import name``: the submodule if ``name`` is one, else pkg itself
                names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                         for alias in node.names]
            for name in names:
                if name == PACKAGE or name.startswith(PACKAGE + "."):
                    target = _known(name, modules)
                    if target is not None and target != module:
                        targets.add(target)
        graph[module] = targets
    return graph


def find_cycle(graph: Dict[str, Set[str]]) -> Optional[List[str]]:
    """One import circle as a path ``[a, b, ..., a]``, or None if the graph is acyclic."""
    done: Set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        path: List[str] = []
        on_path: Set[str] = set()
        stack = [(start, iter(sorted(graph[start])))]
        path.append(start)
        on_path.add(start)
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                path.pop()
                on_path.discard(node)
                done.add(node)
            elif child in on_path:
                return path[path.index(child):] + [child]
            elif child not in done:
                stack.append((child, iter(sorted(graph.get(child, ())))))
                path.append(child)
                on_path.add(child)
    return None


def test_the_graph_sees_the_package():
    graph = import_graph()
    for module in ("elastic_ext", "elastic_ext.state.state", "elastic_ext.state.adapters", "elastic_ext.torch.adapters"):
        assert module in graph, f"{module} missing from the import graph: {sorted(graph)[:10]}..."
    assert "elastic_ext.state.snapshot" in graph["elastic_ext.state.tree"], graph["elastic_ext.state.tree"]
    assert "elastic_ext.state.adapters" in graph["elastic_ext.torch.adapters"], graph["elastic_ext.torch.adapters"]


def test_find_cycle_names_the_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"b"}}) == ["b", "c", "b"]
    knots = {"a": {"b", "c"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}
    assert all_cycles(knots) == [["a", "b", "a"], ["c", "d", "c"]]


def all_cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """One circle per knot: after naming a circle, its closing edge is cut and the search goes on."""
    graph = {module: set(targets) for module, targets in graph.items()}
    cycles = []
    cycle = find_cycle(graph)
    while cycle is not None:
        cycles.append(cycle)
        graph[cycle[-2]].discard(cycle[-1])
        cycle = find_cycle(graph)
    return cycles


def test_no_import_circle():
    cycles = all_cycles(import_graph())
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_the_core_never_imports_a_framework_package():
    offenders = [f"{module} imports {target}"
                 for module, targets in sorted(import_graph().items())
                 if not module.startswith(FRAMEWORK_PACKAGES)
                 for target in sorted(targets) if target.startswith(FRAMEWORK_PACKAGES)]
    assert not offenders, ("framework packages register what they add with the core; "
                           f"the core must not import them: {offenders}")


def _run(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_importing_the_core_imports_no_framework():
    out = _run("import sys, elastic_ext\n"
               "print(sorted(m for m in ('torch', 'tensorflow', 'keras', 'elastic_ext.torch',\n"
               "                         'elastic_ext.tensorflow') if m in sys.modules))")
    assert out.strip() == "[]", out


def test_a_framework_in_the_process_brings_its_registered_adapters_and_rng():
    # The user imports torch and elastic_ext, never elastic_ext.torch.
    out = _run("import sys, torch, elastic_ext\n"
               "from elastic_ext import adapters\n"
               "names = [a.name for a in adapters.adapter_table()]\n"
               "capture = adapters.GlobalRNGAdapter().capture(elastic_ext.GlobalRNG())\n"
               "print(names[:4], names[4:], sorted(capture.meta), 'elastic_ext.torch' in sys.modules)")
    assert out.strip() == ("['torch.module', 'torch.stateful', 'torch.tensor', 'torch.generator'] "
                           "['plain', 'numpy', 'python_random', 'numpy_generator', 'global_rng', 'stateful'] "
                           "['numpy', 'python', 'torch'] True"), out


def test_rng_state_of_a_framework_not_in_the_process_is_a_clear_error():
    out = _run("import random, numpy as np\n"
               "from elastic_ext import GlobalRNG, StateError, adapters\n"
               "from elastic_ext.state.snapshot import Entry\n"
               "adapter = adapters.GlobalRNGAdapter()\n"
               "capture = adapter.capture(GlobalRNG())\n"
               "arrays = {}\n"
               "for key, source in capture.arrays.items():\n"
               "    arrays[key] = np.empty(source.shape, source.dtype)\n"
               "    source.copy_into(arrays[key])\n"
               "entry = Entry(arrays=dict(arrays, **{'torch/cpu': np.zeros(8, np.uint8)}),\n"
               "              meta=dict(capture.meta, torch={'cuda_devices': 0}))\n"
               "try:\n"
               "    adapter.apply(GlobalRNG(), entry)\n"
               "except StateError as exc:\n"
               "    print(exc)\n")
    assert out.strip() == "the commit holds torch RNG state but torch is not imported in this process", out
