"""docs/settings.md lists every ElasticConfig field once, with its default, and nothing else."""

import dataclasses
import os
import re

from elastic_ext.config import ElasticConfig

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs", "settings.md")


def shown(value):
    """A default as the table writes it."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def test_the_settings_table_is_the_config():
    with open(DOC, encoding="utf-8") as handle:
        rows = re.findall(r"^\| `([a-z_]+)` \| ([^|]+) \|", handle.read(), re.MULTILINE)
    table = {name: default.strip() for name, default in rows}
    assert len(rows) == len(table), f"a setting is listed twice: {[name for name, _ in rows]}"
    fields = {f.name: shown(f.default) for f in dataclasses.fields(ElasticConfig)}
    assert table == fields, {"missing": sorted(set(fields) - set(table)),
                             "not a field": sorted(set(table) - set(fields)),
                             "wrong default": sorted(k for k in fields if k in table and table[k] != fields[k])}
