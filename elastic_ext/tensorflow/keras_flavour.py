"""Which Keras a model belongs to: Keras 3 (``keras``) or Keras 2 (``tf_keras``), found from its classes."""

from __future__ import annotations

import sys
from typing import Any

from elastic_ext.errors import ConfigError


def callback_base(model: Any) -> type:
    """The ``Callback`` class of ``model``'s Keras.

    Raises:
        ConfigError: ``model`` is neither a Keras 3 nor a tf_keras model.
    """
    for cls in type(model).__mro__:
        module = cls.__module__ or ""
        if module.startswith("tf_keras"):
            import tf_keras
            return tf_keras.callbacks.Callback
        if module == "keras" or module.startswith("keras."):
            return sys.modules["keras"].callbacks.Callback
    raise ConfigError(f"model ({type(model).__name__}) must be a Keras 3 or tf_keras (Keras 2) model")


def is_keras_model(obj: Any) -> bool:
    """True if ``obj`` is a model of a Keras already imported (3 or tf_keras)."""
    for module_name in ("keras", "tf_keras"):
        module = sys.modules.get(module_name)
        cls = getattr(module, "Model", None) if module is not None else None
        if cls is not None and isinstance(obj, cls):
            return True
    return False
