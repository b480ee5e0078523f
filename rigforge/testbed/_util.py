"""Small helpers shared by the testbed modules: commands, logging, safe directories, ports, pidfiles."""

from __future__ import annotations

import fcntl
import hashlib
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


class TestbedError(RuntimeError):
    """A testbed step failed; the message says which and what to do."""

    __test__ = False  # not a pytest test class


def log(msg: str) -> None:
    print(f"[testbed] {msg}", file=sys.stderr, flush=True)


def sh(cmd: list[str], *, check: bool = True, capture: bool = False, **kw: Any) -> subprocess.CompletedProcess:
    """Run a command; on failure raise TestbedError with its output."""
    kw.setdefault("text", True)
    if capture:
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.PIPE)
    proc = subprocess.run(cmd, **kw)
    if check and proc.returncode != 0:
        out = "" if not capture else f"\n{proc.stdout or ''}{proc.stderr or ''}"
        raise TestbedError(f"command failed (rc={proc.returncode}): {' '.join(map(str, cmd))}{out[-4000:]}")
    return proc


def chroot_env() -> dict[str, str]:
    return {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "LANG": "C.UTF-8",
        "DEBIAN_FRONTEND": "noninteractive",
        "HOME": "/root",
    }


def in_chroot(root: Path, script: str, *, capture: bool = False, check: bool = True) -> subprocess.CompletedProcess:
    """`sh -ec script` in the chroot at `root` (a minimal environment: PATH, C.UTF-8, noninteractive apt)."""
    return sh(["chroot", str(root), "/bin/sh", "-ec", script], env=chroot_env(), capture=capture, check=check)


def ensure_safe_dir(path: Path) -> Path:
    """Create `path` (0755, root) and check every component is root-owned and not group/world writable.

    sshd refuses a ChrootDirectory otherwise, so a testbed under /tmp or a user's home cannot work.
    """
    path = path.absolute()
    path.mkdir(parents=True, exist_ok=True, mode=0o755)
    for comp in [path, *path.parents]:
        st = comp.stat()
        if st.st_uid != 0 or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise TestbedError(
                f"testbed directory {path}: component {comp} must be owned by root and not group/world "
                f"writable (sshd ChrootDirectory rule); use a path like /var/lib/rigforge-testbed"
            )
    return path


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def hash_tree(*paths: Path, extra: str = "") -> str:
    """Stable short hash of files (by relative name and content) under the given paths."""
    h = hashlib.sha256(extra.encode())
    for base in paths:
        files = sorted(p for p in base.rglob("*") if p.is_file()) if base.is_dir() else [base]
        for p in files:
            if "__pycache__" in p.parts:
                continue
            h.update(str(p.relative_to(base.parent)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(start: int, end: int, taken: set[int] = frozenset()) -> int:
    for port in range(start, end):
        if port not in taken and port_free(port):
            return port
    raise TestbedError(f"no free TCP port on 127.0.0.1 in {start}..{end - 1}")


# Machine-wide, not per testbed dir: testbeds in different dirs share 127.0.0.1's ports.
PORTS_LOCK = Path(os.environ.get("RIGFORGE_TESTBED_PORTS_LOCK", "/run/lock/rigforge-testbed-ports.lock"))


@contextmanager
def machine_locked(path: Path = PORTS_LOCK) -> Iterator[None]:
    """Hold a machine-wide lock (by default the port lock: taken while a testbed picks a port and until its own
    listener is up, so two testbeds in any dirs and processes never pick the same free port)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as lock_f:
        fcntl.flock(lock_f, fcntl.LOCK_EX)
        yield


ports_claimed = machine_locked


def listener_inodes(port: int) -> set[str]:
    """Socket inodes listening on TCP `port` (any address), from /proc/net/tcp{,6}."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f[9])
    return inodes


def socket_inodes(pid: int) -> set[str]:
    """Inodes of the sockets process `pid` holds open."""
    inodes = set()
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def _children(pid: int) -> list[int]:
    kids = []
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat_file.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(stat_file.parent.name))
        except (OSError, ValueError, IndexError):
            pass
    return kids


def owns_port(pid: int, port: int) -> bool:
    """Does process `pid` (or a child of it: `git daemon` runs `git-daemon`) listen on TCP `port`?"""
    listeners = listener_inodes(port)
    return any(listeners & socket_inodes(p) for p in [pid, *_children(pid)])


def wait_listener(port: int, pid_of: Callable[[], int | None], what: str, log_file: Path, timeout: float = 10.0) -> int:
    """Wait until the process `pid_of()` itself listens on 127.0.0.1:`port`; return its pid.

    Any other listener on the port (another testbed's sshd, an unrelated server) is not ours: when our process
    dies or does not own the port in time, raise naming `what`, the port, and the tail of `log_file`."""
    deadline = time.monotonic() + timeout
    pid = seen = None
    while time.monotonic() < deadline:
        pid = pid_of()
        if pid and owns_port(pid, port):
            return pid
        if seen and not pid:  # it was running and is gone (e.g. its port was taken)
            break
        seen = seen or pid
        time.sleep(0.05)
    try:
        tail = " | ".join(log_file.read_text(errors="replace").strip().splitlines()[-3:])
    except OSError:
        tail = ""
    other = "another process listens there" if listener_inodes(port) else "nothing listens there"
    state = f"pid {pid} does not own the port" if pid else "it is not running"
    raise TestbedError(
        f"{what} did not start on 127.0.0.1:{port}: {state} ({other}); log {log_file}: {tail or '(empty)'}"
    )


def pid_alive(pidfile: Path) -> int | None:
    """Return the pid in `pidfile` if that process is alive, else None."""
    try:
        pid = int(pidfile.read_text().strip())
    except (OSError, ValueError):
        return None
    try:
        os.kill(pid, 0)
    except OSError:
        return None
    try:  # a zombie is not alive
        if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z":
            return None
    except OSError:
        return None
    return pid


def stop_pidfile(pidfile: Path, timeout: float = 5.0) -> None:
    pid = pid_alive(pidfile)
    if pid:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while pid_alive(pidfile) and time.monotonic() < deadline:
            time.sleep(0.05)
        if pid_alive(pidfile):
            os.kill(pid, signal.SIGKILL)
    pidfile.unlink(missing_ok=True)


def spawn(cmd: list[str], pidfile: Path, logfile: Path, env: dict | None = None) -> int:
    """Start a detached background process (own session), record its pid."""
    with open(logfile, "ab") as log_f:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log_f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
            close_fds=True,
        )
    pidfile.write_text(f"{proc.pid}\n")
    return proc.pid
