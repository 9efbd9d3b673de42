"""Gloo's full-mesh rendezvous in one request per rank (elastic_ext.launch.gloo_exchange), through the driver's
real, guarded rendezvous server, against what Gloo's own protocol gives each rank.

Gloo's ``connectFullMesh`` reads, from every peer p's value (p's pair addresses, one per other rank in rank
order), the address at rank r's index: r below p, r - 1 above (``extractAddress``), and counts as r's local
rank the lower ranks with r's host name. The exchange must hand each rank exactly that. Both ways the addresses
travel in compact form (``gloo_exchange.compact``), as the patched ``HTTPStore`` sends and reads them.
"""

import argparse
import os
import threading

import pytest
from horovod.runner.common.util.hosts import SlotInfo

from elastic_ext.control import horovod_seam
from elastic_ext.launch import command_line, gloo_exchange
from tests.unit.horovod_restore import changes  # noqa: F401 - a fixture
from tests.unit.test_store_guard import job, request, snapshot  # noqa: F401 - job is a fixture

ITEM = 136  # Gloo's TCP address: sockaddr_storage and a sequence number


def gloos_own(blobs, hosts, rank):
    """(local rank, addresses for ``rank``) as Gloo's connectFullMesh reads them one peer at a time."""
    local = sum(1 for peer in range(rank) if hosts[peer] == hosts[rank])
    column = b"".join(blobs[peer][(rank if rank < peer else rank - 1) * ITEM:][:ITEM]
                      for peer in range(len(blobs)) if peer != rank)
    return local, column


def addresses(host, count):
    """``count`` addresses of a rank on ``host`` as Gloo's TCP transport makes them: one listening socket per
    pair, so they differ only in the port (bytes 2 and 3 of the sockaddr)."""
    first = bytes([2, 0, 0, 0]) + host.encode()[:4].ljust(4, b"x") + bytes(ITEM - 8)
    return b"".join(first[:2] + (40000 + 7 * i).to_bytes(2, "big") + first[4:]
                    for i in range(count))


def put(job, scope, hosts, rank, blob):
    """One rank's exchange as the patched HTTPStore sends it: (status, body with its addresses expanded)."""
    size = len(hosts)
    status, body = request(job, "PUT", f"/{scope}/_mesh_{rank}_{size}_{ITEM}",
                           hosts[rank].encode() + b"\n" + gloo_exchange.compact(blob, size - 1, ITEM))
    if status != 200:
        return status, body
    local, _, packed = body.partition(b"\n")
    return status, local + b"\n" + gloo_exchange.expand(packed, size - 1, ITEM, "the answer")


def exchange_all(job, scope, hosts, blobs):
    """Every rank's PUT at once, each asking again on a 404 as the patched HTTPStore does: {rank: answer}."""
    answers = {}

    def rank_of(rank):
        while True:
            status, body = put(job, scope, hosts, rank, blobs[rank])
            if status != 404:
                answers[rank] = (status, body)
                return

    threads = [threading.Thread(target=rank_of, args=(rank,)) for rank in range(len(hosts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return answers


@pytest.mark.parametrize("made", ["as Gloo makes them", "at random"])
def test_every_rank_gets_in_one_request_what_gloos_own_protocol_reads_one_peer_at_a_time(job, made):
    hosts = ["host-a", "host-a", "host-b", "host-a"]  # the job's round: 4 ranks
    blobs = [addresses(host, len(hosts) - 1) if made == "as Gloo makes them" else os.urandom(ITEM * (len(hosts) - 1))
             for host in hosts]
    answers = exchange_all(job, "global", hosts, blobs)
    assert sorted(answers) == list(range(len(hosts)))
    for rank, (status, body) in answers.items():
        assert status == 200, (rank, status, body[:200])
        local, _, column = body.partition(b"\n")
        assert (int(local), column) == gloos_own(blobs, hosts, rank), rank
    # Kept until the next round: a reader of Gloo's own protocol reads each rank's host name and its
    # addresses whole under Gloo's keys, though the cache holds the addresses compact only.
    stored = snapshot(job)["global"]
    assert all(stored[f"rank_{rank}"] == hosts[rank].encode() for rank in range(len(hosts)))
    assert all(request(job, "GET", f"/global/{rank}") == (200, blobs[rank]) for rank in range(len(hosts)))
    assert not any(key.isdigit() for key in stored)
    if made == "as Gloo makes them":  # only the ports differ: the first address and 2 bytes of each other
        assert all(len(stored[f"_mesh_{rank}"]) < 136 + 16 + 2 * len(hosts) for rank in range(len(hosts)))


@pytest.mark.parametrize("key", ["9" * 5000, "\u00b2", "1_2"])
def test_a_read_of_a_key_that_is_no_ranks_is_horovods_plain_read(job, key):
    exchange_all(job, "global", ["host-a"] * 3, [os.urandom(ITEM * 2) for _ in range(3)])
    assert gloo_exchange.whole(job.server._httpd, "global", key) is None  # (int() refuses both digit strings)
    if key.isascii():
        assert request(job, "GET", f"/global/{key}") == (404, b"")


def test_a_rank_is_held_then_answered_404_until_the_last_one_has_published(job, monkeypatch):
    monkeypatch.setattr(gloo_exchange, "HOLD_S", 0.2)
    blobs = [os.urandom(ITEM * 2) for _ in range(3)]
    first = put(job, "local_host-a", ["host-a"] * 3, 0, blobs[0])
    assert first == (404, b"")
    answers = exchange_all(job, "local_host-a", ["host-a"] * 3, blobs)
    assert {rank: status for rank, (status, _) in answers.items()} == {0: 200, 1: 200, 2: 200}
    assert answers[0][1] == b"0\n" + blobs[1][:ITEM] + blobs[2][:ITEM]


def test_a_rank_whose_answer_was_lost_asks_again_and_gets_the_same_answer(job):
    hosts = ["host-a", "host-b", "host-b"]
    blobs = [os.urandom(ITEM * 2) for _ in hosts]
    first = exchange_all(job, "cross_1", hosts, blobs)
    again = put(job, "cross_1", hosts, 2, blobs[2])
    assert again == first[2] and again[0] == 200


def test_a_new_round_exchanges_afresh_in_the_same_scope(job):
    blobs = [os.urandom(ITEM * 2) for _ in range(3)]
    exchange_all(job, "global", ["host-a"] * 3, blobs)
    # the driver's next round, of 2 ranks: Horovod clears the store
    job.server._httpd.init([SlotInfo("host-a", 0, 0, 0, 2, 1, 2), SlotInfo("host-b", 1, 0, 1, 2, 1, 2)])
    smaller = [os.urandom(ITEM) for _ in range(2)]
    answers = exchange_all(job, "global", ["host-a", "host-b"], smaller)
    assert answers == {0: (200, b"0\n" + smaller[1][:ITEM]), 1: (200, b"0\n" + smaller[0][:ITEM])}


def test_the_compact_form_carries_only_the_bytes_where_a_ranks_addresses_differ():
    blob = addresses("host-a", 1023)
    packed = gloo_exchange.compact(blob, 1023, ITEM)
    assert len(packed) == 2 + 2 * 2 + ITEM + 1023 * 2  # the port's two bytes: 2,188 bytes instead of 139,128
    assert gloo_exchange.expand(packed, 1023, ITEM, "x") == blob


@pytest.mark.parametrize("key, body, named", [
    ("_mesh_x", b"h\n", "'_mesh_x'"),
    ("_mesh_3_2_136", b"h\n" + b"a" * 136, "0 <= rank < size"),
    ("_mesh_0_2_0", b"h\n", "0 < item bytes"),
    ("_mesh_0_7712_136", b"h\n\0\0" + b"a" * 136, "7711 addresses of 136 bytes exceed the 1048576 bytes"),
    ("_mesh_0_2_4", b"h" + b"a" * 4, "without a newline"),
    ("_mesh_0_3_4", b"h\n" + b"a" * 4, "got 4 bytes for K = 24929 (99722 expected)"),
    ("_mesh_0_3_4", b"h\n\x01\x00\x00\x00abcdxy" + b"z", "got 11 bytes for K = 1 (10 expected)"),
    ("_mesh_0_3_4", b"h\n\x02\x00\x03\x00\x01\x00abcdwxyz", "offsets [3, 1] must rise"),
    ("_mesh_0_3_4", b"h\n\x01\x00\x04\x00abcdxy", "offsets [4] must rise and stay below"),
])
def test_a_malformed_exchange_is_answered_400_naming_what_is_wrong_and_stores_nothing(job, key, body, named):
    with pytest.raises(ValueError) as raised:
        gloo_exchange.parse(key, body, 1 << 16)
    assert named in str(raised.value)
    assert request(job, "PUT", f"/cross_0/{key}", body)[0] == 400
    assert "cross_0" not in snapshot(job)


@pytest.mark.parametrize("ranks, named", [(4, "5 ranks, but the round has 4"), (None, "5 ranks, but no round is open")])
def test_an_exchange_larger_than_the_round_is_answered_400_and_stores_nothing(job, ranks, named):
    body = b"h\n" + gloo_exchange.compact(addresses("h", 4), 4, ITEM)  # a well-formed body: 5 ranks of 136
    with pytest.raises(ValueError) as raised:
        gloo_exchange.parse(f"_mesh_0_5_{ITEM}", body, ranks)
    assert named in str(raised.value)
    assert gloo_exchange.round_ranks(job.server._httpd) == 4
    assert request(job, "PUT", f"/global/_mesh_0_5_{ITEM}", body)[0] == 400
    assert "global" not in snapshot(job)


@pytest.mark.parametrize("patches, expected", [((gloo_exchange.PATCH,), "1"), ((), None)])
def test_the_launcher_asks_workers_for_the_exchange_only_where_the_build_carries_the_patch(monkeypatch, patches,
                                                                                            expected):
    from horovod.runner import launch

    monkeypatch.setenv(gloo_exchange.ENV, "0")  # restored (absent) after the test
    monkeypatch.delenv(gloo_exchange.ENV)
    monkeypatch.setattr(horovod_seam, "build_patches", lambda: patches)
    monkeypatch.setattr(launch, "parse_args", lambda: argparse.Namespace(command=[], min_num_proc=None))
    [(_, _, parse)] = command_line.worker_entry_changes()
    parse()
    assert os.environ.get(gloo_exchange.ENV) == expected
