"""The driver's clients of the workers' notification services load only Horovod's answer classes.

The driver registers a client for every worker's notification service
(``worker_addresses``, :mod:`elastic_ext.launch.store_guard`), pings it,
and sends it host changes and job notices. Horovod's client checks each
answer's HMAC with the key that came with the registration, then loads
the answer with cloudpickle: whoever registered a service chose that key,
so a registration from anyone but a worker would make the driver load
whatever its service answers. Under the launcher (:func:`client_class`) the
driver's client loads an answer with an unpickler that allows Horovod's
three answer classes and no other global; anything else fails the request
as an unreachable service does.
"""

from __future__ import annotations

import functools
import io
import pickle
import struct
from typing import Any


MAX_ANSWER_BYTES = 1 << 20  # an answer is a few hundred bytes
ANSWERS = frozenset({("horovod.runner.common.util.network", name)
                     for name in ("AckResponse", "AckStreamResponse", "PingResponse")})


class _Answers(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ANSWERS:
            raise pickle.UnpicklingError(f"a worker service's answer may not hold {module}.{name}")
        return super().find_class(module, name)


def load_answer(key: bytes, rfile: Any) -> Any:
    """Reads one answer as Horovod's ``Wire.read`` does (digest, length, body), loading only :data:`ANSWERS`.

    Raises:
        pickle.UnpicklingError: a wrong digest or size, or a global that is not an answer class.
    """
    from horovod.runner.common.util import secret

    digest = rfile.read(secret.DIGEST_LENGTH)
    length = struct.unpack("i", rfile.read(4))[0]  # Horovod's framing: a native int
    if not 0 <= length <= MAX_ANSWER_BYTES:
        raise pickle.UnpicklingError(f"a worker service's answer of {length} bytes")
    message = rfile.read(length)
    if not secret.check_digest(key, message, digest):
        raise pickle.UnpicklingError("a worker service's answer does not carry its key's digest")
    return _Answers(io.BytesIO(message)).load()


@functools.lru_cache(maxsize=None)
def client_class() -> type:
    """Horovod's ``WorkerNotificationClient`` whose answers are loaded by :func:`load_answer`: the client
    the launcher's driver (:func:`elastic_ext.launch.driver.driver_class`) registers for each worker."""
    from horovod.runner.common.util.network import Wire
    from horovod.runner.elastic.driver import WorkerNotificationClient

    class AnswerWire(Wire):  # type: ignore[misc, valid-type]
        def read(self, rfile: Any) -> Any:
            return load_answer(self._key, rfile)

    class Client(WorkerNotificationClient):  # type: ignore[misc, valid-type]
        @property
        def _wire(self) -> Any:
            return self.__dict__["_answer_wire"]

        @_wire.setter
        def _wire(self, wire: Any) -> None:  # Horovod's BasicClient sets it, then pings the service at once
            self.__dict__["_answer_wire"] = AnswerWire(wire._key)

    return Client


__all__ = ["ANSWERS", "MAX_ANSWER_BYTES", "client_class", "load_answer"]
