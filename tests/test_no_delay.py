"""TCP_NODELAY and quick ACKs on the SSH connection (rigforge/observe/inventory.py `no_delay`): set on a TCP socket,
left alone where there is none (a ProxyCommand's pipe, a connector without a client)."""

from __future__ import annotations

import socket
import subprocess
import sys
from types import SimpleNamespace

import paramiko
import pytest
from support import FIRST_RIG_CONNECTED, REPO

from rigforge.observe.inventory import no_delay


def _host(sock_or_transport):
    has_packets = hasattr(sock_or_transport, "packetizer")
    transport = sock_or_transport if has_packets else SimpleNamespace(sock=sock_or_transport)
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


def _pingpong(sock, peer):
    """A few request-reply exchanges: Linux then delays `sock`'s ACKs (it is "interactive": TCP_QUICKACK reads 0)."""
    for _ in range(3):
        peer.sendall(b"request")
        sock.recv(100)
        sock.sendall(b"reply")
        peer.recv(100)


def test_each_read_of_the_ssh_connection_is_acknowledged_at_once():
    with socket.create_server(("127.0.0.1", 0)) as server:
        peer = socket.create_connection(server.getsockname())
        sock, _ = server.accept()
        with peer, sock:
            transport = paramiko.Transport(sock)  # not started: its packet reader over this socket
            try:
                no_delay(_host(transport))
                reader = transport.packetizer._Packetizer__socket
                no_delay(_host(transport))  # idempotent: wrapped once
                assert reader is transport.packetizer._Packetizer__socket and reader is not sock
                _pingpong(sock, peer)
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK) == 0  # ACKs delayed again
                peer.sendall(b"host keys notice")
                assert reader.recv(100) == b"host keys notice"
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK) == 1  # the next one at once
            finally:
                transport.packetizer._Packetizer__socket = sock


def test_a_controller_without_quick_acks_still_gets_no_delay(monkeypatch):
    """TCP_QUICKACK is Linux's: where the controller's system has none (macOS), TCP_NODELAY alone, nothing raised."""
    import rigforge.observe.inventory

    monkeypatch.setattr(rigforge.observe.inventory, "QUICKACK", None)
    with socket.create_server(("127.0.0.1", 0)) as server:
        with socket.create_connection(server.getsockname()) as sock:
            transport = paramiko.Transport(sock)
            no_delay(_host(transport))
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
            assert transport.packetizer._Packetizer__socket is sock  # the reader left as paramiko made it


RECONNECT = (
    FIRST_RIG_CONNECTED
    + """
import socket
from rigforge.observe.inventory import _QuickAck, quick_connections, ssh_transport
def quick():
    transport = ssh_transport(host)
    nodelay = transport.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    return nodelay and isinstance(transport.packetizer._Packetizer__socket, _QuickAck)
seen = [quick()]  # as pyinfra connected it
quick_connections([host])  # the deploy's first step (rigforge/observe/facts/probe.py install_all)
seen.append(quick())
host.disconnect(); host.connect()  # what server.reboot does once the rig is back: a new connection
seen.append(quick() and ssh_transport(host).get_remote_server_key() is not None)
print(seen)
"""
)


@pytest.mark.testbed
def test_a_connection_pyinfra_opens_again_after_a_reboot_gets_no_delay_too(testbed_factory):
    """The connections the deploy found open get it when the deploy starts, and a new one (the reconnect after
    `server.reboot` in the driver role) gets it from the SSH connector itself, over real SSH to a testbed rig."""
    from rigforge.testbed import RigSpec

    tb = testbed_factory([RigSpec()], name="nodelay")
    run = subprocess.run(
        [sys.executable, "-c", RECONNECT, str(tb.inventory)], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "[False, True, True]", run.stdout + run.stderr[-2000:]
