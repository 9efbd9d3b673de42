"""Tests read worker output through :mod:`elastic_ext.testing.analysis` (re-exported here)."""

from elastic_ext.testing.analysis import *  # noqa: F401,F403
