"""The package's import structure: no circle, the layer rule, and a framework-free core.

The graph is read from the source, not from a running import, so an import
inside a function counts as much as one at the top of a module: a circle
through a function-level import is still two modules that cannot be
understood (or moved) one without the other. Imports under
``if TYPE_CHECKING:`` count too: a type names a dependency as much as a call
does. Importing ``a.b.c`` also runs the ``__init__`` of ``a`` and ``a.b``;
those implicit edges are left out, since every submodule would otherwise
close a circle with its package.

The layer rule (``docs/architecture.md`` draws it): the leaves (``config`` with ``config_text``,
``errors``, ``events``, ``binding``, ``liveness``, ``exit_codes``) import nothing above them; ``data/`` and
``discovery/`` only the leaves; ``policies/`` also ``data/``, ``discovery/`` and
``state/`` (they plug into the commit, :mod:`elastic_ext.state.commit_slots`); ``state/`` never
``policies/`` (the public State is assembled with them in ``runtime/``); ``state/`` and
``checkpoint/`` never ``runtime/`` nor ``launch/``; the launcher's rooms by process: ``launch/`` (the
driver's process) imports only ``control/`` (what driver and workers share) and ``discovery/`` (its host
rules), ``worker/`` (a worker's entry and what it installs) only ``control/``, and ``control/`` neither of
them; ``testing/`` (the public test helpers: one-rank and threaded
bindings) only ``state/`` and ``runtime/``; no module imports the public face (``elastic_ext`` itself) or
``testing/``; no module of the package imports the repository's ``devkit/`` or ``tests/``, which are not
shipped (the wheel holds ``elastic_ext`` alone); and only ``launch/``, ``worker/`` and ``control/`` touch
Horovod's private modules. No
module is over 300 lines.
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


def _import_nodes(tree: ast.AST) -> List[ast.stmt]:
    """Every import statement at any depth, ``if TYPE_CHECKING:`` blocks included."""
    return [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]


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


LEAVES = {"elastic_ext.config", "elastic_ext.config_text", "elastic_ext.errors", "elastic_ext.events", "elastic_ext.binding",
          "elastic_ext.liveness", "elastic_ext.exit_codes"}
# room -> the rooms it may import (besides itself and the leaves); None: any room but the forbidden ones.
MAY_IMPORT = {
    "leaves": set(),
    "data": set(),
    "discovery": set(),
    "policies": {"data", "discovery", "state"},
    "state": {"data", "discovery", "checkpoint"},  # never policies: they plug in through state.commit_slots
    "checkpoint": {"state"},
    "control": set(),  # the store's keys and client, the seam's check and record, the notice messages
    "launch": {"control", "discovery"},  # the driver's process; discovery's host rules
    "worker": {"control"},  # a worker's entry and what it installs: nothing of the driver's process
    "runtime": {"data", "discovery", "policies", "state", "checkpoint", "worker", "control"},
    "torch": {"data", "policies", "state"},
    "tensorflow": {"data", "policies", "state"},
    "testing": {"state", "runtime"},  # state_on builds the State that runtime/ assembles
    "public": {"data", "discovery", "policies", "state", "checkpoint", "launch", "worker", "control", "runtime"},
}


def room(module: str) -> str:
    """The subpackage a module lives in (``leaves`` for the top-level leaves, ``public`` for ``elastic_ext``)."""
    if module == PACKAGE:
        return "public"
    if module in LEAVES:
        return "leaves"
    parts = module.split(".")
    if len(parts) < 2 or parts[1] not in MAY_IMPORT:
        raise AssertionError(f"{module} is in no room of the layer rule {sorted(MAY_IMPORT)}: give it one")
    return parts[1]


def layer_violations(graph: Dict[str, Set[str]]) -> List[str]:
    """``a imports b`` for every edge the layer rule forbids."""
    found = []
    for module, targets in sorted(graph.items()):
        own = room(module)
        for target in sorted(targets):
            other = room(target)
            if other not in (own, "leaves") and other not in MAY_IMPORT[own]:
                found.append(f"{module} ({own}) imports {target} ({other})")
    return found


def test_every_module_of_the_package_is_in_a_room_and_at_most_8_stay_at_the_top():
    modules = sorted(import_graph())
    rooms = {module: room(module) for module in modules}
    top = [m for m in modules if m.count(".") == 1 and not os.path.isdir(os.path.join(REPO, *m.split(".")))]
    assert len(top) + 1 <= 8, f"{len(top)} modules beside __init__.py at the top of elastic_ext: {top}"
    assert {"state", "runtime", "launch", "data", "policies"} <= set(rooms.values()), rooms


def test_the_layer_rule_holds():
    violations = layer_violations(import_graph())
    assert not violations, "edges against the layer rule:\n" + "\n".join(violations)


def unshipped_imports() -> List[str]:
    """``module imports name`` for every import of the package (any depth) of ``devkit`` or ``tests``."""
    found = []
    for module, path in sorted(module_files().items()):
        with open(path, encoding="utf-8") as handle:
            tree = ast.parse(handle.read(), path)
        for node in _import_nodes(tree):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [f"{module} imports {name}" for name in names
                      if not getattr(node, "level", 0) and name.split(".")[0] in ("devkit", "tests")]
    return found


def test_the_package_imports_nothing_that_is_not_shipped():
    """``devkit/`` (launchers, fake servers, faults, ledger) and ``tests/`` stay out of the wheel and of the package."""
    from setuptools import find_packages
    shipped = find_packages(REPO, include=["elastic_ext", "elastic_ext.*"])
    assert "elastic_ext.testing" in shipped and not [p for p in shipped if not p.startswith(PACKAGE)], shipped
    assert os.path.isfile(os.path.join(REPO, "devkit", "launch.py")), "devkit/ moved: update this test"
    assert not unshipped_imports(), unshipped_imports()


def test_the_examples_carry_no_test_hook():
    """The training examples are what users copy: they import neither the package's test helpers nor the
    repository's ``devkit/`` or ``tests/``; the demo and the tests watch them from outside
    (``devkit/watched.py``). ``run_demo.py`` is the demo's runner, not a training script."""
    examples = os.path.join(REPO, "examples")
    scripts = sorted(n for n in os.listdir(examples) if n.endswith(".py") and n != "run_demo.py")
    assert "pytorch_elastic.py" in scripts, scripts
    found = []
    for name in scripts:
        with open(os.path.join(examples, name), encoding="utf-8") as handle:
            tree = ast.parse(handle.read())
        for node in _import_nodes(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [f"{name} imports {n}" for n in names
                      if n.split(".")[0] in ("devkit", "tests") or n.startswith("elastic_ext.testing")]
    assert not found, found


def test_state_imports_no_policy():
    """The policies plug into the commit (:mod:`elastic_ext.state.commit_slots`); the core names none."""
    graph = import_graph()
    edges = [f"{module} imports {target}" for module, targets in sorted(graph.items()) if room(module) == "state"
             for target in sorted(targets) if room(target) == "policies"]
    assert not edges, f"state/ imports policies/: {edges}"
    assert "elastic_ext.state.commit_slots" in graph["elastic_ext.policies.eviction"], graph["elastic_ext.policies.eviction"]
    assert layer_violations({"elastic_ext.state.decisions": {"elastic_ext.policies.eviction"}}) == [
        "elastic_ext.state.decisions (state) imports elastic_ext.policies.eviction (policies)"]


def private_state_calls(source: str) -> List[str]:
    """``state._name`` and ``self.state._name`` (not dunders) in ``source``: a private member of a State."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id == "state") or \
                    (isinstance(owner, ast.Attribute) and owner.attr == "state"):
                found.append(f"{node.lineno}: {node.attr}")
    return found


def test_the_run_loop_uses_only_the_states_public_contract():
    """runtime/ steers the State through its public methods (docs/state.md, "What the run loop may call")."""
    offenders = []
    for module, path in module_files().items():
        if room(module) == "runtime" and module != "elastic_ext.runtime.assembly":
            with open(path, encoding="utf-8") as handle:
                offenders += [f"{module}:{hit}" for hit in private_state_calls(handle.read())]
    assert not offenders, f"runtime/ calls private members of the State: {offenders}"
    assert sorted(private_state_calls("state._hosts.settle()\nself.state._x()\nstate.commit()")) == ["1: _hosts", "2: _x"]


def test_the_layer_rule_catches_an_edge_up():
    assert layer_violations({"elastic_ext.state.sync": {"elastic_ext.runtime.run"}}) == [
        "elastic_ext.state.sync (state) imports elastic_ext.runtime.run (runtime)"]
    assert layer_violations({"elastic_ext.data.sampler": {"elastic_ext.binding"}}) == []


MAX_MODULE_LINES = 300  # the house rule (docs/architecture.md): a module longer than this is split by responsibility


def modules_over(limit: int, files: Dict[str, str]) -> List[str]:
    """``"module: N lines"`` for each of ``files`` (module -> path) longer than ``limit`` lines."""
    found = []
    for module, path in sorted(files.items()):
        with open(path, encoding="utf-8") as handle:
            count = sum(1 for _ in handle)
        if count > limit:
            found.append(f"{module}: {count} lines")
    return found


def test_every_module_of_the_package_is_at_most_300_lines():
    too_long = modules_over(MAX_MODULE_LINES, module_files())
    assert not too_long, f"modules over {MAX_MODULE_LINES} lines (split them by responsibility): {too_long}"


def test_the_line_limit_catches_a_long_module(tmp_path):
    short, long = tmp_path / "short.py", tmp_path / "long.py"
    short.write_text("x = 1\n" * MAX_MODULE_LINES)
    long.write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    assert modules_over(MAX_MODULE_LINES, {"a.short": str(short), "a.long": str(long)}) == [
        f"a.long: {MAX_MODULE_LINES + 1} lines"]


def test_the_exit_codes_are_a_leaf_that_imports_nothing_of_the_project():
    assert import_graph()["elastic_ext.exit_codes"] == set()


def test_no_module_but_exit_codes_defines_a_worker_exit_code():
    """A module-level ``*EXIT*`` name bound to one of the codes (or an ``os._exit`` of one's literal) outside it."""
    from elastic_ext import exit_codes

    codes = set(exit_codes.MEANINGS)
    found = []
    for module, path in module_files().items():
        if module == "elastic_ext.exit_codes":
            continue
        with open(path, encoding="utf-8") as handle:
            tree = ast.parse(handle.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and node.value.value in codes:
                names = [t.id for t in node.targets if isinstance(t, ast.Name) and "EXIT" in t.id.upper()]
                found.extend(f"{module}: {name} = {node.value.value}" for name in names)
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) in ("_exit", "exit") and node.args \
                    and isinstance(node.args[0], ast.Constant) and node.args[0].value in codes:
                found.append(f"{module}: exit({node.args[0].value})")
    assert not found, f"worker exit codes defined outside elastic_ext/exit_codes.py: {found}"


def test_no_module_binds_one_name_from_two_modules():
    """``from a import X`` and ``from b import X`` in one module: the later import silently wins (an event
    named by an exit code went out as ``143`` instead of ``"leave"`` that way)."""
    found = []
    for module, path in module_files().items():
        with open(path, encoding="utf-8") as handle:
            tree = ast.parse(handle.read(), path)
        bound = {}
        for node in tree.body:
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    name = alias.asname or alias.name
                    if name in bound and bound[name] != node.module:
                        found.append(f"{module}: {name} from {bound[name]} and from {node.module}")
                    bound[name] = node.module
    assert not found, found


# Horovod's documented API; anything else of Horovod (its runner, basics, process sets) is private.
HOROVOD_PUBLIC = ("horovod.torch", "horovod.tensorflow", "horovod.common.exceptions", "horovod.common.elastic")


def horovod_imports() -> Dict[str, Set[str]]:
    """Module -> the Horovod modules it imports (top level, in functions, or for types)."""
    found: Dict[str, Set[str]] = {}
    for module, path in module_files().items():
        with open(path, encoding="utf-8") as handle:
            tree = ast.parse(handle.read(), path)
        names = set()
        for node in _import_nodes(tree):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif node.module and not node.level:
                names.update(f"{node.module}.{alias.name}" if node.module == "horovod.common" else node.module
                             for alias in node.names)
        found[module] = {name for name in names if name == "horovod" or name.startswith("horovod.")}
    return found


def test_only_launch_touches_horovods_private_modules():
    imports = horovod_imports()
    assert "horovod.runner.launch" in imports["elastic_ext.launch.horovodrun"], imports["elastic_ext.launch.horovodrun"]
    offenders = [f"{module} imports {name}" for module, names in sorted(imports.items())
                 if room(module) not in ("launch", "worker", "control") for name in sorted(names)
                 if not any(name == public or name.startswith(public + ".") for public in HOROVOD_PUBLIC)]
    assert not offenders, f"Horovod's private modules outside launch/, worker/ and control/: {offenders}"


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
               "from elastic_ext.state import adapters\n"
               "names = [a.name for a in adapters.adapter_table()]\n"
               "capture = adapters.GlobalRNGAdapter().capture(elastic_ext.GlobalRNG())\n"
               "print(names[:4], names[4:], sorted(capture.meta), 'elastic_ext.torch' in sys.modules)")
    assert out.strip() == ("['torch.module', 'torch.stateful', 'torch.tensor', 'torch.generator'] "
                           "['plain', 'numpy', 'python_random', 'numpy_generator', 'global_rng', 'stateful'] "
                           "['numpy', 'python', 'torch'] True"), out


def test_rng_state_of_a_framework_not_in_the_process_is_a_clear_error():
    out = _run("import random, numpy as np\n"
               "from elastic_ext import GlobalRNG, StateError\n"
               "from elastic_ext.state import adapters\n"
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


def horovod_changes_in(source: str, path: str = "<source>") -> List[int]:
    """Lines of ``source`` that set an attribute of a name imported from Horovod (a class, a module, an
    object), by assignment or ``setattr``/``delattr``: a change of Horovod."""
    tree = ast.parse(source, path)
    names: Set[str] = set()
    for node in _import_nodes(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level and node.module.split(".")[0] == "horovod":
            names.update(alias.asname or alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.asname or alias.name.split(".")[0] for alias in node.names
                         if alias.name.split(".")[0] == "horovod")
    lines = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            if isinstance(target, ast.Attribute):
                base = target
                while isinstance(base, ast.Attribute):
                    base = base.value
                if isinstance(base, ast.Name) and base.id in names:
                    lines.append(node.lineno)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr") \
                and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id in names:
            lines.append(node.lineno)
    return sorted(lines)


def test_only_horovod_changes_changes_horovod():
    """The seam: its two halves (elastic_ext.launch.horovod_changes, the driver's process;
    elastic_ext.worker.horovod_changes, a worker's) make every change of Horovod, through
    elastic_ext.control.horovod_seam.make; the other modules say what
    they would change (or subclass Horovod's classes)."""
    offenders = []
    for module, path in module_files().items():
        if module not in ("elastic_ext.launch.horovod_changes", "elastic_ext.worker.horovod_changes"):
            with open(path, encoding="utf-8") as handle:
                offenders += [f"{module}:{line}" for line in horovod_changes_in(handle.read(), path)]
    assert not offenders, f"Horovod changed outside the seam's two halves: {offenders}"


def test_the_seam_check_catches_a_change_of_horovod():
    source = ("from horovod.runner import launch\nfrom horovod.common.basics import HorovodBasics as B\n"
              "import horovod.torch\n"
              "launch.parse_args = None\nsetattr(B, 'init', None)\nhorovod.torch.init = None\nx = launch.parse_args\n")
    assert sorted(horovod_changes_in(source)) == [4, 5, 6]


def test_the_launchers_rooms_are_split_by_process():
    """Each module of the launcher runs in one process: the driver's (``launch/``) or a worker's (``worker/``);
    what both use is in ``control/``, which imports neither."""
    graph = import_graph()
    crossing = [f"{module} imports {target}" for module, targets in sorted(graph.items())
                for target in sorted(targets)
                if {room(module), room(target)} == {"launch", "worker"}
                or (room(module) == "control" and room(target) in ("launch", "worker"))]
    assert not crossing, f"the launcher's processes mixed: {crossing}"
    rooms = {room(module) for module in graph}
    assert {"launch", "worker", "control"} <= rooms, rooms
