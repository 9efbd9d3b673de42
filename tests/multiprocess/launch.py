"""Tests launch jobs through :mod:`elastic_ext.testing.launch` (re-exported here)."""

from elastic_ext.testing.launch import *  # noqa: F401,F403
