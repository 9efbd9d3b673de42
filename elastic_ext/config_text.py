"""How the text of an ``ELASTIC_EXT_*`` variable becomes a setting's value (for :mod:`elastic_ext.config`)."""

from __future__ import annotations

from typing import Union

from elastic_ext.errors import ConfigError

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def parse_bool(name: str, text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ConfigError(f"{name} ({text!r}) must be one of {sorted(_TRUE | _FALSE)}")


def parse_int(name: str, text: str, expected: str = "an integer") -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ConfigError(f"{name} ({text!r}) must be {expected}") from None


def parse_float(name: str, text: str) -> float:
    try:
        return float(text.strip())
    except ValueError:
        raise ConfigError(f"{name} ({text!r}) must be a number") from None


def parse_every(name: str, text: str) -> Union[int, str]:
    """An integer, or "auto" (``checkpoint_every``)."""
    return "auto" if text.strip().lower() == "auto" else parse_int(name, text, "an integer or 'auto'")


#: How a variable's text becomes a field's value, by the type of the field's default (None: a path).
PARSERS = {bool: parse_bool, int: parse_int, float: parse_float, type(None): lambda name, text: text}
