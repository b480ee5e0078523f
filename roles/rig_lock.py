"""One rigforge run per rig: a lock on the rig that lives exactly as long as this run's SSH connection.

`send()` starts, as root on one more channel of the run's connection, a holder: `flock -n` on the lock file, the
run's owner line beside it, then `cat` until the channel closes. When the run ends or its link drops, `cat` ends and
the lock frees itself (a killed run's owner line stays: the next run says it found one). Once it holds the lock the
holder runs the batched probe: one round trip (docs/probe.md). One machine under two inventory names is told apart
by `twins()` (machine-id and SSH host key) and by the owner line, which names the holding name.
"""

import atexit
import base64
import contextlib
import hashlib
import os
import shlex
import socket
from collections.abc import Iterator
from datetime import UTC, datetime

from paramiko import Channel
from pyinfra import logger
from pyinfra.api import Host, State, StringCommand
from pyinfra.context import ctx_host

from rigforge.groups import is_rig
from rigforge.layout import RUN_LOCK
from rigforge.observe.facts import probe
from rigforge.observe.inventory import ssh_transport, sudo_of, sudo_password_problem

MACHINE_ID = "/etc/machine-id"
_HELD: dict[str, object] = {}  # host name -> the open channel whose holder keeps the rig's lock
_SENT: dict[str, tuple] = {}  # host name -> (channel, path, run, then, sudo -n) of a request not read yet
_IDENTITY: dict[str, tuple[str, str] | None] = {}  # host name -> (machine-id, SSH host key fingerprint)


def identity(h: Host) -> tuple[str, str] | None:
    """(machine-id, SHA256 fingerprint of its SSH host key as ssh-keygen -l prints it) of `h`; None: either unknown."""
    if h.name not in _IDENTITY:
        found = None
        if (transport := ssh_transport(h)) is not None:
            digest = hashlib.sha256(transport.get_remote_server_key().asbytes()).digest()
            key = "SHA256:" + base64.b64encode(digest).decode().rstrip("=")
            # a plain read (the file is world-readable), not a fact: a fact read would run the rig's batched probe
            # before its lock is held, and with sudo before sudo is known to work
            ok, output = h.run_shell_command(StringCommand("cat", MACHINE_ID))
            machine = "".join(output.stdout_lines).strip() if ok else ""
            found = (machine, key) if machine else None
        _IDENTITY[h.name] = found
    return _IDENTITY[h.name]


def twins(h: Host) -> list[str]:
    """The names of this run's other rigs that reach the same machine as `h`."""
    others = [o for o in h.inventory.iter_activated_hosts() if is_rig(o) and o.name != h.name]
    mine = identity(h) if others else None  # with no other host there is nothing to read
    return sorted(o.name for o in others if mine is not None and identity(o) == mine)


def _holder(path: str, owner: str, then: list | None = None) -> str:
    """The holder's shell script (see the module's docstring); `then`: [command, end line, ...] to run once held."""
    info = shlex.quote(f"{path}.owner")
    # once it holds the lock, the command `then` asks for (the batched probe): its output, a newline (ends a last
    # line without one), the end line, its exit code
    run = f"( {then[0]} ) </dev/null 2>/dev/null; r=$?; echo; echo {shlex.quote(then[1])}; echo $r; " if then else ""
    return (
        f"exec 9>>{shlex.quote(path)} || exit 1; "
        f"if flock -n 9; then "
        f'  [ -s {info} ] && echo "STALE $(sed "s/^[0-9]* //" {info})"; '
        f'  echo "$$ "{shlex.quote(owner)} > {info}; echo LOCKED; {run}cat >/dev/null; rm -f {info}; '
        # held: the owner line starts with the holder's pid on the rig. The holder writes it just after it takes
        # the lock: a holder caught between the two (a busy rig) is waited for, up to 2 s, so that its line is
        # read, not an empty file, nor the line a killed run left (its pid is gone). A line with no pid (written by
        # a rigforge before 588c708) is read as it is
        f"else n=0; while [ $n -lt 40 ]; do read -r pid who < {info} 2>/dev/null && case $pid in "
        f'*[!0-9]*) who="$pid $who"; break ;; *) kill -0 "$pid" 2>/dev/null && break ;; esac; '
        f"who=; sleep 0.05; n=$((n + 1)); done; "
        f'echo "BUSY $who"; fi'
    )


def _lines(channel: Channel) -> Iterator[str]:
    """The holder's answer lines (not paramiko's file objects, which may not be finalized after gevent's hub)."""
    buffer = b""
    while chunk := channel.recv(65536):
        *lines, buffer = (buffer + chunk).split(b"\n")  # each chunk split once, not once per line
        yield from (line.decode(errors="replace") for line in lines)  # as pyinfra reads them: without the newline


def _release() -> None:
    """Close every lock channel of this run (at exit): each holder's cat ends and its lock frees itself."""
    for channel in [*_HELD.values(), *(sent[0] for sent in _SENT.values())]:
        with contextlib.suppress(Exception):  # a connection already gone took its lock with it
            channel.close()  # the holder's cat ends, the owner line goes, the lock is free
    _HELD.clear()
    _SENT.clear()


atexit.register(_release)  # once, at import: closing nothing when nothing was sent


def over_ssh(host: Host) -> bool:
    """Whether `host` is reached over SSH (the lock needs a channel of the run's connection)."""
    return getattr(host.connector, "client", None) is not None


def send(host: Host, path: str, sudo: bool, then: list | None = None, password: str | None = None) -> None:
    """Ask for `path` on `host` on a channel of its own, the rig running `then` once it holds it (`take` reads it)."""
    if asked(host) or not over_ssh(host):
        return
    run = f"{socket.gethostname()}, pid {os.getpid()}"
    owner = f"{run} (as {host.name}), since {datetime.now(UTC).isoformat(timespec='seconds')}"
    command = f"sh -c {shlex.quote(_holder(path, owner, then))}"
    channel = ssh_transport(host).open_session()
    password = password if sudo else None
    if password:  # sudo reads it from the channel's first line; the holder's cat reads the rest
        channel.exec_command(f"sudo -S -p '' {command}")
        channel.sendall(f"{password}\n".encode())
    elif sudo:  # a sudo that wants a password refuses, on stderr (`take` reads it), instead of asking for one
        channel.exec_command(f"sudo -n {command}")
    else:
        channel.exec_command(command)
    _SENT[host.name] = (channel, path, run, then, sudo and not password)


def ask(host: Host) -> None:
    """Send `host`'s lock request with its batched probe, once; a twin is not asked (roles/site.py `hold_the_rig`)."""
    if not over_ssh(host) or asked(host) or (is_rig(host) and twins(host)):
        return
    sudo, _, password = sudo_of(host)
    send(host, RUN_LOCK, sudo, probe.lock_request(host), password)


def ask_first() -> None:
    """A deploy's first step: the rig answers the lock request while the controller loads the roles."""
    probe.install_all()
    ask(ctx_host.get())


def asked(host: Host) -> bool:
    """Whether `host`'s lock request was sent (and not read yet) or its lock is held."""
    return host.name in _SENT or host.name in _HELD


def retake(state: State, host: Host, path: str = RUN_LOCK) -> bool:
    """After a reboot, take `host`'s lock again on the new connection; False (the host fails): another run took it."""
    if _HELD.pop(host.name, None) is None:  # never held: not over SSH
        return True
    sudo, _, password = sudo_of(host)
    send(host, path, sudo, None, password)
    problem, _ = take(host)  # a line the reboot left: none, /run/lock is cleared at boot
    if problem:
        host.log_styled(f"after the reboot: {problem}", fg="red", log_func=logger.error)
    return problem is None


def take(host: Host) -> tuple[str | None, str | None]:
    """(problem, note) of `host`'s request (`send`): the lock held for this run, or who holds it; idempotent. Once
    held, `then`'s None becomes its command's output lines, then its exit code (stays None when it did not run)."""
    if host.name in _HELD or not over_ssh(host):
        return None, None
    channel, path, run, then, sudo_n = _SENT.pop(host.name)  # sent by `ask` (or `send`) before
    note = None
    lines = _lines(channel)
    for line in lines:
        line = line.strip()
        if line.startswith("STALE "):
            note = f"found the lock of an earlier run that is gone ({line[6:]}); this run takes it over"
        elif line == "LOCKED":
            _HELD[host.name] = channel  # kept open: the holder lives as long as this channel
            if then:
                output = []
                for out in lines:
                    if out == then[1]:  # the end line
                        if output[-1:] == [""]:
                            output.pop()  # drop the newline echoed before the end line (the output ended in one)
                        then[2] = [*output, next(lines, "").strip()]  # the command's lines, then its exit code
                        break
                    output.append(out)
            return None, note
        elif line.startswith("BUSY"):
            channel.close()
            holder = line[5:] or "another run"
            name = holder[len(run) :].removeprefix(" (as ").partition(")")[0] if holder.startswith(run) else ""
            if name not in ("", host.name):  # this very run holds it under another name (answer read or not yet)
                return (
                    f"{host.name} and {name} are one machine (this run holds its lock {path} as {name}): remove one "
                    "of the two names from the inventory"
                ), None
            return f"{host.name} is being provisioned by {holder}; wait for that run to end, then run again", None
    said = b""  # what sudo -n said on stderr, read to its end
    if sudo_n:
        while True:
            chunk = channel.recv_stderr(4096)
            if not chunk:  # the channel's stderr is closed
                break
            said += chunk
    channel.close()
    if b"password is required" in said:  # sudo -n's refusal: nothing ran as root
        return sudo_password_problem(host, ssh_transport(host).get_username()), None
    return f"{host.name}: could not take the rig's lock {path} (sudo and flock are needed on the rig)", None
