"""The event names: every one emitted in the package is a documented constant of events.py."""

import ast
import os

from elastic_ext import events

PACKAGE = os.path.dirname(os.path.abspath(events.__file__))


def emitted_names():
    """(file, event name) for every ``emit(...)``/``_emit(...)`` call in elastic_ext."""
    found = []
    for root, _, files in os.walk(PACKAGE):
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(root, name)
            with open(path, encoding="utf-8") as handle:
                tree = ast.parse(handle.read(), path)
            for node in ast.walk(tree):
                if not (isinstance(node, ast.Call) and node.args):
                    continue
                func = node.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                if called not in ("emit", "_emit"):
                    continue
                arg = node.args[0]
                if isinstance(arg, ast.Constant):
                    found.append((path, arg.value))
                elif isinstance(arg, ast.Attribute):  # events.ROLLBACK
                    found.append((path, getattr(events, arg.attr, f"<unknown constant {arg.attr}>")))
                elif isinstance(arg, ast.Name):  # from elastic_ext.events import ROLLBACK
                    found.append((path, getattr(events, arg.id, f"<unknown constant {arg.id}>")))
    return found


def test_every_emitted_event_is_a_known_name():
    unknown = [(os.path.relpath(path, PACKAGE), name) for path, name in emitted_names()
               if name not in events.ALL_EVENTS]
    assert not unknown, f"emitted but not in events.ALL_EVENTS: {unknown}"


def test_every_known_name_is_emitted_somewhere():
    emitted = {name for _, name in emitted_names()}
    assert set(events.ALL_EVENTS) - emitted == set()


def test_every_name_is_documented_in_the_module_docstring():
    for name in events.ALL_EVENTS:
        assert f"``{name}``" in events.__doc__, name
    assert len(set(events.ALL_EVENTS)) == len(events.ALL_EVENTS)


def test_read_events_reads_what_emit_wrote(tmp_path):
    log = events.EventLog(str(tmp_path / "events-{rank}.jsonl"), rank_fn=lambda: 3, size_fn=lambda: 4)
    log.emit(events.FINISH, commit_id=7)
    records = events.read_events(str(tmp_path / "events-3.jsonl"))
    assert [(r["event"], r["rank"], r["size"], r["commit_id"]) for r in records] == [("finish", 3, 4, 7)]


def test_read_events_of_a_missing_file_is_empty(tmp_path):
    assert events.read_events(str(tmp_path / "never-written.jsonl")) == []
