"""TCP_NODELAY on the SSH connection (rigforge/inventory.py `no_delay`): set on a TCP socket, left alone where
there is none (a ProxyCommand's pipe, a connector without a client)."""

from __future__ import annotations

import socket
from types import SimpleNamespace

from rigforge.inventory import no_delay


def _host(sock):
    transport = SimpleNamespace(sock=sock)
    return SimpleNamespace(connector=SimpleNamespace(client=SimpleNamespace(get_transport=lambda: transport)))


def test_the_ssh_socket_sends_small_packets_at_once():
    with socket.create_server(("127.0.0.1", 0)) as server:
        with socket.create_connection(server.getsockname()) as sock:
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 0  # what paramiko leaves
            no_delay(_host(sock))
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
            no_delay(_host(sock))  # idempotent
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


def test_a_connection_that_is_not_tcp_is_left_alone():
    left, right = socket.socketpair()
    with left, right:
        no_delay(_host(left))  # a unix socket has no TCP options: nothing set, nothing raised
    no_delay(_host(SimpleNamespace()))  # a ProxyCommand: no socket family
    no_delay(_host(None))  # no transport
    no_delay(SimpleNamespace(connector=SimpleNamespace()))  # @local / @fake: no client
