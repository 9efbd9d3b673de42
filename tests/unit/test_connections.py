"""This process's established TCP connections, asked of its own sockets (elastic_ext/runtime/connections.py)."""

import os
import socket

import pytest

from elastic_ext.runtime import connections


@pytest.fixture
def sockets():
    """Established pairs over IPv4 and over an IPv6 socket, beside what must not be listed:
    listening sockets, a connection in CLOSE_WAIT, a UDP socket, a Unix socket pair."""
    made = []

    def keep(*socks):
        made.extend(socks)
        return socks

    server, = keep(socket.create_server(("127.0.0.1", 0)))
    client, = keep(socket.create_connection(server.getsockname()))
    accepted, = keep(server.accept()[0])
    server6, = keep(socket.create_server(("::", 0), family=socket.AF_INET6, dualstack_ipv6=True))
    client6, = keep(socket.create_connection(("127.0.0.1", server6.getsockname()[1])))
    accepted6, = keep(server6.accept()[0])
    closing, = keep(socket.create_server(("127.0.0.1", 0)))
    waiting, = keep(socket.create_connection(closing.getsockname()))
    closing.accept()[0].close()  # `waiting` is in CLOSE_WAIT now
    udp, = keep(socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
    udp.connect(("127.0.0.1", 9))
    keep(*socket.socketpair())
    yield {"pairs": [(client, accepted), (client6, accepted6)], "waiting": waiting}
    for sock in made:
        sock.close()


def key(sock):
    """What established() lists for ``sock``: every address here is 127.0.0.1, whichever the family."""
    return sock.fileno(), ("127.0.0.1", sock.getsockname()[1]), ("127.0.0.1", sock.getpeername()[1])


def test_only_established_tcp_connections_are_listed_with_plain_ipv4_addresses(sockets):
    listed = set(connections.established(skip_ports=set()))
    expected = {key(sock) for pair in sockets["pairs"] for sock in pair}
    assert expected <= listed, f"missing: {expected - listed}"
    assert sockets["waiting"].fileno() not in {fd for fd, _, _ in listed}, "a CLOSE_WAIT socket was listed"


def test_the_same_connections_as_psutil_reads_from_proc_net_tcp(sockets):
    assert sorted(connections.established(skip_ports=set())) == \
        sorted(connections._established_by_psutil(set()))


def test_connections_to_a_skipped_port_are_left_out(sockets):
    client, accepted = sockets["pairs"][0]
    port = client.getpeername()[1]  # the server's port: client -> port is left out, accepted -> client is not
    listed = connections.established(skip_ports={port})
    assert key(client) not in listed
    assert key(accepted) in listed


def test_listing_leaves_every_connection_open(sockets):
    client, accepted = sockets["pairs"][0]
    for _ in range(3):
        connections.established(skip_ports=set())
    client.sendall(b"still here")
    assert accepted.recv(16) == b"still here"


def test_listing_leaves_each_socket_s_blocking_mode_as_it_was(sockets):
    client, accepted = sockets["pairs"][0]
    client.setblocking(False)
    connections.established(skip_ports=set())
    assert client.getblocking() is False and accepted.getblocking() is True
    assert os.get_blocking(client.fileno()) is False and os.get_blocking(accepted.fileno()) is True


@pytest.fixture
def default_timeout():
    """A default socket timeout, as a library may set: a socket object made then is non-blocking."""
    socket.setdefaulttimeout(5.0)
    yield
    socket.setdefaulttimeout(None)


def test_with_a_default_socket_timeout_no_socket_turns_non_blocking(sockets, default_timeout):
    client, accepted = sockets["pairs"][0]
    assert key(client) in connections.established(skip_ports=set())
    assert os.get_blocking(client.fileno()) and os.get_blocking(accepted.fileno())
