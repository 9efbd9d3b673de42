"""A forger of the driver's store requests, run on one host of the test cluster (standard library only).

    python forger.py ADDRESS PORT ROUND MARKERS HOST [HOST ...]

Sends, without the job's secret: a GET of the round's number; a base64
pickle whose loading creates the directory ``MARKERS/worker_addresses``,
PUT to ``worker_addresses``; a garbage round number; ``failed_`` of
``ROUND`` (or of the number the GET read, when it read one) and of the
next round; the dismissal of each HOST's first slot; the early-start
marker and rank 0's ready key; a preemption notice for each HOST. Prints
one JSON object: request -> HTTP status, or the name of the error that
ended the request without one (a connection closed unanswered, refused,
timed out).
"""

import base64
import http.client
import json
import os
import pickle
import sys

TIMEOUT_S = 2.0  # a handful of requests within the cluster's 30 s command bound, even where each times out


class MakesMarker:
    """Pickles to a call of ``os.mkdir(path)``: whoever loads it creates ``path``."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


def send(address, port, method, path, body=None):
    connection = http.client.HTTPConnection(address, port, timeout=TIMEOUT_S)
    try:
        connection.request(method, path, body=body)
        response = connection.getresponse()
        return response.status, response.read()
    except (OSError, http.client.HTTPException) as exc:
        return type(exc).__name__, b""
    finally:
        connection.close()


def main(argv):
    address, port, round_id, markers, hosts = argv[0], int(argv[1]), int(argv[2]), argv[3], argv[4:]
    statuses = {}
    status, body = send(address, port, "GET", "/elastic_ext_round/current")
    statuses["GET /elastic_ext_round/current"] = status
    if status == 200 and body.isdigit():
        round_id = int(body)
    statuses["round"] = round_id
    pickled = base64.b64encode(pickle.dumps(MakesMarker(os.path.join(markers, "worker_addresses"))))
    requests = [("PUT", f"/worker_addresses/{hosts[0]}:0", pickled),
                ("PUT", "/elastic_ext_round/current", b"not-a-round"),
                ("PUT", f"/elastic_ext_round/failed_{round_id}", f"{hosts[0]}[0]".encode()),
                ("PUT", f"/elastic_ext_round/failed_{round_id + 1}", f"{hosts[-1]}[0]".encode()),
                ("PUT", "/elastic_ext_ready/early_start", b"1"),
                ("PUT", "/elastic_ext_ready/0", b"1")]
    requests += [("PUT", f"/elastic_ext_round/dismissed_{host}:0", b"1") for host in hosts]
    requests += [("PUT", f"/elastic_ext_notice/{host}", b"1") for host in hosts]
    for method, path, value in requests:
        statuses[f"{method} {path}"] = send(address, port, method, path, value)[0]
    print(json.dumps(statuses))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
