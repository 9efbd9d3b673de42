"""The commands of setup.py: the launcher, and one discovery command per script in
host_discovery/ that calls the same function."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import re
from pathlib import Path

import pytest

from elastic_ext.discovery.cli import EXIT_OK

REPO = Path(__file__).resolve().parents[2]
PREFIX = "elastic-ext-discover-"
# command suffix -> the executable in host_discovery/
SCRIPTS = {"slurm": "slurm.py", "aws-spot": "aws_spot.py", "static": "static.py"}
LAUNCHER = {"elastic-horovodrun": "elastic_ext.launch.horovodrun:main"}


def declared_console_scripts() -> dict:
    """``{command: "module:function"}`` from setup.py's entry_points, read without running it."""
    tree = ast.parse((REPO / "setup.py").read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "entry_points":
            entry_points = ast.literal_eval(node.value)
            return dict(re.split(r"\s*=\s*", spec, maxsplit=1) for spec in entry_points["console_scripts"])
    raise AssertionError("setup.py declares no entry_points")


def resolve(target: str):
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def test_the_launcher_and_one_command_per_discovery_script():
    assert sorted(declared_console_scripts()) == sorted([*LAUNCHER, *(PREFIX + name for name in SCRIPTS)])
    assert {name: declared_console_scripts()[name] for name in LAUNCHER} == LAUNCHER
    assert callable(resolve(LAUNCHER["elastic-horovodrun"]))


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_command_resolves_to_the_function_its_script_calls(name, capsys):
    target = declared_console_scripts()[PREFIX + name]
    function = resolve(target)
    script = (REPO / "host_discovery" / SCRIPTS[name]).read_text(encoding="utf-8")
    assert f"import {function.__name__}\n" in script
    with pytest.raises(SystemExit) as exit_info:  # argparse ends --help with exit 0
        function(["--help"])
    assert exit_info.value.code == EXIT_OK
    assert "--timeout-s" in capsys.readouterr().out


def test_an_installed_distribution_declares_the_same_commands():
    # tools/setup.sh installs the checkout with `pip install -e`; an install
    # made before the commands existed has none of them, and one made after
    # must carry exactly setup.py's.
    ours = declared_console_scripts()
    installed = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="console_scripts")
                 if ep.name in ours or ep.name.startswith(PREFIX)}
    assert installed in ({}, ours)
