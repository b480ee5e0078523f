"""Network namespaces of booted rigs, and a TCP relay across them (standard library only).

A booted rig lives in its own network namespace (/run/netns/<name>, made with `ip netns add`, so it outlives
reboots of the rig). Its Docker engine makes bridges and iptables rules there, never on the controller. The
testbed's booted hosts reach one another over a LAN of their own (booted.join_lan: a bridge, a veth per host),
never through a relay. Nothing crosses between a rig and the controller except through this relay:

    python3 netns.py serve NETNS SPEC ...
      [ADDR:]PORT=HOST:PORT[,throttle=FILE]
                       listen on ADDR:PORT (default 127.0.0.1) inside the rig, connect to HOST:PORT from the
                       controller (apt / git / HF stand-ins, the Debian mirror; the upstream registry stand-in
                       at registry-1.docker.io's address in the rig, port 443). With throttle=FILE, what comes
                       back to the rig is limited to the bytes per second FILE holds (0 or no file: full speed),
                       re-read every THROTTLE_REREAD seconds, shared by all connections of that listener
      PORT=CONNECT:0   the same, as an HTTPS proxy (CONNECT to port 443 only: pip's index)
      in:[ADDR:]PORT=RPORT
                       listen on the controller's ADDR:PORT (default 127.0.0.1), connect to 127.0.0.1:RPORT
                       inside the rig (its sshd: pyinfra, ssh and testinfra reach it like a chroot rig's; its
                       API ports, published at the rig's own loopback address on the controller)
      at:ADDR:PORT=NETNS@RPORT
                       listen on ADDR:PORT inside the rig, connect to 127.0.0.1:RPORT inside another namespace
                       (each host reaches the fleet registry at its address, in the registry host)
"""

from __future__ import annotations

import ctypes
import os
import socket
import sys
import threading
import time

CLONE_NEWNET = 0x40000000
THROTTLE_REREAD = 0.25  # seconds between reads of a throttle file
THROTTLE_RCVBUF = 65536  # receive buffer of a throttled listener's upstream connections


class Throttle:
    """A token bucket whose rate (bytes per second, 0 = none) is re-read from a file while data flows."""

    def __init__(self, path: str) -> None:
        self.path, self.lock = path, threading.Lock()
        self.rate, self.read_at, self.tokens, self.at = 0, 0.0, 0.0, time.monotonic()

    def _rate(self, now: float) -> int:
        if now - self.read_at >= THROTTLE_REREAD:
            self.read_at = now
            try:
                with open(self.path) as fh:
                    self.rate = max(0, int(fh.read().strip() or 0))
            except (OSError, ValueError):
                self.rate = 0
        return self.rate

    def chunk(self) -> int:
        """How much to read at once: small when throttled, so the rate is smooth."""
        rate = self._rate(time.monotonic())
        return 65536 if not rate else max(1024, min(65536, rate // 20))

    def take(self, n: int) -> None:
        """Wait until `n` bytes may pass."""
        while True:
            with self.lock:
                now = time.monotonic()
                rate = self._rate(now)
                if not rate:
                    self.tokens, self.at = 0.0, now
                    return
                self.tokens = min(self.tokens + (now - self.at) * rate, max(rate / 10, n))
                self.at = now
                if self.tokens >= n:
                    self.tokens -= n
                    return
                wait = (n - self.tokens) / rate
            time.sleep(min(wait, THROTTLE_REREAD))


def setns(path: str) -> None:
    """Move the calling thread into the network namespace at `path`."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


def _pipe(src: socket.socket, dst: socket.socket, throttle: Throttle | None = None) -> None:
    try:
        while data := src.recv(throttle.chunk() if throttle else 65536):
            if throttle:
                throttle.take(len(data))
            dst.sendall(data)
    except OSError:
        pass
    try:
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def _pair(a: socket.socket, b: socket.socket, throttle: Throttle | None = None) -> None:
    back = threading.Thread(target=_pipe, args=(b, a, throttle), daemon=True)
    back.start()
    _pipe(a, b)
    back.join()
    a.close()
    b.close()


def _connect_request(conn: socket.socket) -> tuple[str, int] | None:
    """Read an HTTP proxy `CONNECT host:443` request; the target, or None (answered 403) for anything else."""
    head = b""
    while b"\r\n\r\n" not in head and len(head) < 8192:
        chunk = conn.recv(4096)
        if not chunk:
            return None
        head += chunk
    parts = head.split(b"\r\n", 1)[0].decode("latin-1").split()
    if len(parts) == 3 and parts[0] == "CONNECT" and parts[1].endswith(":443"):
        return parts[1].rsplit(":", 1)[0], 443
    conn.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
    return None


def _forward(
    listener: socket.socket, target: tuple[str, int], netns: str | None = None, throttle: Throttle | None = None
) -> None:
    if netns:
        setns(netns)  # this thread's upstream connections are made inside the rig
    while True:
        conn, _ = listener.accept()
        try:
            dest = _connect_request(conn) if target[0] == "CONNECT" else target
            if dest is None:
                conn.close()
                continue
            if throttle:  # a small receive window: the server sends about what the rig gets, not into a buffer
                upstream = socket.socket()
                upstream.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, THROTTLE_RCVBUF)
                upstream.settimeout(10)
                upstream.connect(dest)
            else:
                upstream = socket.create_connection(dest, timeout=10)  # made in the controller's namespace
            upstream.settimeout(None)
            if target[0] == "CONNECT":
                conn.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
        except OSError:
            conn.close()
            continue
        threading.Thread(target=_pair, args=(conn, upstream, throttle), daemon=True).start()


def serve(netns: str, specs: list[str]) -> None:
    home = os.open(f"/proc/self/task/{threading.get_native_id()}/ns/net", os.O_RDONLY)
    forwards = []  # (listener, target, namespace the upstream connections are made in)
    for spec in specs:
        if spec.startswith("in:"):
            where, _, rport = spec[3:].partition("=")
            addr, _, port = where.rpartition(":")
            forwards.append((_listen(int(port), addr or "127.0.0.1"), ("127.0.0.1", int(rport)), netns))
    setns(netns)
    try:
        for spec in specs:
            if spec.startswith("at:"):
                where, _, target = spec[3:].partition("=")
                addr, _, port = where.rpartition(":")
                other, _, rport = target.rpartition("@")
                forwards.append((_listen(int(port), addr), ("127.0.0.1", int(rport)), other))
            elif not spec.startswith("in:"):
                where, _, target = spec.partition("=")
                addr, _, port = where.rpartition(":")
                target, _, throttle = target.partition(",throttle=")
                host, _, tport = target.rpartition(":")
                limit = Throttle(throttle) if throttle else None
                forwards.append((_listen(int(port), addr or "127.0.0.1"), (host, int(tport)), None, limit))
    finally:
        setns(f"/proc/self/fd/{home}")
        os.close(home)
    print(f"relay for {netns}: {' '.join(specs)}", flush=True)
    threads = [threading.Thread(target=_forward, args=item, daemon=True) for item in forwards]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _listen(port: int, addr: str = "127.0.0.1") -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((addr, port))
    s.listen(64)
    return s


if __name__ == "__main__":
    if len(sys.argv) < 4 or sys.argv[1] != "serve":
        sys.exit(f"usage: {sys.argv[0]} serve NETNS PORT=HOST:PORT|PORT=CONNECT:0|in:PORT=RPORT|at:A:P=NS@RP ...")
    serve(sys.argv[2], sys.argv[3:])
