"""errors.py is the whole hierarchy: every error elastic_ext defines derives from ElasticExtError."""

import inspect

import elastic_ext
from elastic_ext import discovery, errors


def test_every_listed_error_derives_from_the_base():
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, errors.ElasticExtError), name


def test_every_error_class_of_the_module_is_listed():
    defined = {name for name, obj in vars(errors).items()
               if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == errors.__name__}
    assert defined == set(errors.__all__)


def test_discovery_errors_are_the_ones_of_errors_py():
    for name in ("DiscoveryInputError", "DiscoveryUnavailableError", "DiscoveryTimeoutError"):
        assert getattr(discovery, name) is getattr(errors, name)
        assert issubclass(getattr(errors, name), errors.DiscoveryError)
    assert issubclass(errors.DiscoveryTimeoutError, errors.DiscoveryUnavailableError)
    assert issubclass(errors.DiscoveryInputError, ValueError)
    assert elastic_ext.DiscoveryError is errors.DiscoveryError

