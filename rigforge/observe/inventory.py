"""The commands' inventory and SSH plumbing: every host read in parallel, read-only commands and HTTP on a rig.
Nothing here changes a rig.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import os
import shlex
import socket
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # imported where used: a deploy file's first step imports this module before the roles
    from paramiko import Transport
    from pyinfra.api import Host, State, StringCommand
    from pyinfra.connectors.ssh import SSHConnector

    from rigforge.model import fleet
    from rigforge.model.schema import Settings


class RigApi(Protocol):
    """What a request to a rig's API reads of its context: rigforge/observe/hosts.py's RigContext (not imported:
    observe.py reads the rig through facts/probe.py, which imports this module)."""

    @property
    def data(self) -> dict: ...

    @property
    def port(self) -> int | None: ...

    @property
    def settings(self) -> Settings: ...


class InventoryError(Exception):
    """The inventory could not be loaded (exit 2)."""


# ---------------------------------------------------------------- inventory and SSH plumbing


def open_inventory(path: str, override: dict | None = None) -> State:
    """A pyinfra State over the inventory file, group_data/ applied; `override`: pyinfra's --data."""
    if not Path(path).is_file():
        raise InventoryError(f"{path}: no such inventory file (give a pyinfra inventory, e.g. inventories/home.py)")
    # pyinfra_cli patches sockets for gevent on import (that is what makes the SSH sessions parallel): import
    # it here, only in commands that use SSH. Under `rigforge`, ssl was already imported (requests, for bench);
    # gevent then warns that ssl is not patched: nothing here uses ssl (SSH is paramiko over patched sockets).
    import warnings

    from gevent.monkey import MonkeyPatchWarning

    warnings.filterwarnings("ignore", category=MonkeyPatchWarning)
    from pyinfra.api import Config, State
    from pyinfra.context import ctx_config, ctx_inventory, ctx_state
    from pyinfra_cli.inventory import make_inventory

    logging.getLogger("pyinfra").setLevel(logging.CRITICAL)  # errors are reported in our own output
    # paramiko logs a traceback when a port answers but no SSH does (a rig booting or powered off behind a forwarded
    # port): for_each_host says it in one line, naming the host
    logging.getLogger("paramiko").setLevel(logging.CRITICAL + 1)
    state = State(check_for_changes=False)  # set up as the pyinfra CLI does, so group_data files load
    state.cwd = os.getcwd()
    ctx_state.set(state)
    config = Config()
    ctx_config.set(config)
    try:
        inventory = make_inventory(path, override_data=override, cwd=state.cwd)
    except Exception as exc:
        raise InventoryError(f"{path}: cannot load the inventory: {exc}") from None
    if not len(inventory):
        raise InventoryError(f"{path}: the inventory lists no hosts")
    ctx_inventory.set(inventory)
    state.init(inventory, config)
    return state


def ssh_transport(host: Host) -> Transport | None:
    """`host`'s SSH transport (paramiko), or None: not over SSH (@local, @fake) or not connected."""
    client = getattr(host.connector, "client", None)
    return client.get_transport() if client is not None else None


QUICKACK = getattr(socket, "TCP_QUICKACK", None)  # Linux's; a controller elsewhere (macOS) has no such option


class _QuickAck:
    """The SSH socket as paramiko's packet reader sees it: TCP_QUICKACK again after each read (Linux drops it)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)

    def recv(self, size: int, *flags: int) -> bytes:
        data = self._sock.recv(size, *flags)
        with contextlib.suppress(OSError):
            self._sock.setsockopt(socket.IPPROTO_TCP, QUICKACK, 1)
        return data


def no_delay(host: Host) -> None:
    """TCP_NODELAY on `host`'s SSH connection, and TCP_QUICKACK after each read where the system has it (docs/probe.md
    "No wait for a delayed ACK"); nothing for a connection that is not TCP (a ProxyCommand) or not open. Idempotent:
    a second call sets the same options and wraps the socket only once."""
    transport = ssh_transport(host)
    sock = getattr(transport, "sock", None)
    if getattr(sock, "family", None) not in (socket.AF_INET, socket.AF_INET6):
        return
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if QUICKACK is not None:
            sock.setsockopt(socket.IPPROTO_TCP, QUICKACK, 1)  # an ACK held back now goes now
    packets = getattr(transport, "packetizer", None)
    if QUICKACK is not None and not isinstance(getattr(packets, "_Packetizer__socket", None), (_QuickAck, type(None))):
        packets._Packetizer__socket = _QuickAck(packets._Packetizer__socket)


def quick_connections(hosts: Iterable[Host] = ()) -> None:
    """`no_delay` on every SSH connection pyinfra opens from now on and, once, on those `hosts` have open already."""
    from pyinfra.connectors.ssh import SSHConnector

    if hasattr(SSHConnector.connect, "__wrapped__"):
        return
    original = SSHConnector.connect

    @functools.wraps(original)
    def connect(self: SSHConnector, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        no_delay(self.host)

    SSHConnector.connect = connect
    for host in hosts:
        no_delay(host)


def for_each_host(state: State, fn: Callable[[Host], Any]) -> dict[str, Any]:
    """Connect to every host and run fn(host) on each in parallel: {host name: result or Exception}."""
    import gevent

    def task(host: Host) -> Any:
        try:
            host.connect(show_errors=False, raise_exceptions=True)
        except Exception as exc:
            return Unreachable(f"cannot connect: {_one_line(exc)}")
        state.activate_host(host)
        try:
            return Unreachable(problem) if (problem := _command_problem(host)) else fn(host)
        except Exception as exc:
            return Unreachable(f"{type(exc).__name__}: {_one_line(exc)}")
        finally:
            with contextlib.suppress(Exception):
                host.disconnect()

    quick_connections()
    jobs = {host.name: state.pool.spawn(task, host) for host in state.inventory}
    gevent.joinall(list(jobs.values()))
    return {name: job.value for name, job in jobs.items()}


def sudo_problem(h: Host) -> str | None:
    """The one line when sudo on host `h` asks for a password host data does not give; asked with `sudo -n`."""
    from pyinfra.api import QuoteString, StringCommand

    sudo, user, password = sudo_of(h)
    if not sudo or password:
        return None
    as_user = f" -u {shlex.quote(str(user))}" if user else ""
    # sudo's own "a password is required" never reaches pyinfra, which would prompt for one on seeing it
    check = (
        f'id -un; out=$(sudo -n{as_user} true 2>&1) && echo SUDO-OK || case "$out" in '
        '*"password is required"*) echo SUDO-PASSWORD;; *) echo SUDO-OTHER;; esac'
    )
    _, output = h.run_shell_command(StringCommand("sh", "-c", QuoteString(check)))
    lines = [line.strip() for line in output.stdout_lines]
    if "SUDO-PASSWORD" not in lines:
        return None  # sudo works, or fails otherwise (said by whatever runs next)
    return sudo_password_problem(h, lines[0] if lines and lines[0] != "SUDO-PASSWORD" else None)


def sudo_of(h: Host) -> tuple[bool, str | None, str | None]:
    """(whether commands run with sudo, as which user, its password) from `h`'s host data."""
    return bool(h.data.get("_sudo")), h.data.get("_sudo_user"), h.data.get("_sudo_password")


def sudo_password_problem(h: Host, user: str | None) -> str:
    """The one line for host `h` whose sudo asks SSH user `user` (None: not known) for a password."""
    user = user or h.data.get("ssh_user") or "the SSH user"
    return (
        f"sudo asks {user} for a password on {h.name}: rigforge needs passwordless sudo for {user} (a sudoers line "
        f"'{user} ALL=(ALL) NOPASSWD:ALL') or the password in host data _sudo_password"
    )


class Unreachable(Exception):
    """A host that could not be read (for_each_host's result): its message says why."""


def _command_problem(host: Host) -> str | None:
    """Why commands cannot run on a connected host (e.g. sudo wants a password); None when they can."""
    from pyinfra.api import StringCommand

    if problem := sudo_problem(host):  # asked without a prompt: pyinfra's own would wait for a TTY, then fail
        return problem
    sudo, user, _ = sudo_of(host)
    ok, output = host.run_shell_command(StringCommand("true"), _sudo=sudo, **({"_sudo_user": user} if user else {}))
    if ok:
        return None
    why = " ".join(line.strip() for line in output.stderr_lines[:2]) or "no error output"
    return (
        f"connected, but cannot run commands {'with sudo ' if sudo else ''}({why}); "
        "the SSH user needs passwordless sudo (check _sudo / _sudo_user in host data)"
    )


def _one_line(exc: BaseException) -> str:
    """An exception's message on one line (its whitespace collapsed), else its class name."""
    text = str(exc.args[0]) if exc.args else str(exc)
    return " ".join(text.split()) or type(exc).__name__


def sh(host: Host, command: str | StringCommand) -> str:
    """Output of a read-only command on the host (the host's `_sudo` applies). Never fails: `|| true`."""
    from pyinfra.api import StringCommand
    from pyinfra.facts.server import Command

    return host.get_fact(Command, command=StringCommand("(", command, ") 2>/dev/null || true")) or ""


def add_arguments(p: argparse.ArgumentParser, shown: str = "a table") -> None:
    """A command's INVENTORY argument and --json (JSON instead of `shown`)."""
    p.add_argument("inventory", metavar="INVENTORY", help="pyinfra inventory file, e.g. inventories/fleet.py")
    p.add_argument("--json", action="store_true", help=f"print JSON instead of {shown}")


def read_fleet(
    args: argparse.Namespace, command: str, fn: Callable[[Host, fleet.Fleet], Any]
) -> tuple[dict[str, Any], fleet.Fleet] | None:
    """(fn(host, fleet) for every host of `args.inventory`; the fleet), or None when the inventory does not load."""
    try:
        state = open_inventory(args.inventory)
    except InventoryError as exc:
        print(f"rigforge {command}: {exc}", file=sys.stderr)
        return None
    from rigforge.model import fleet

    fl = fleet.build(state.inventory, deployable=False, opt_in=True)
    return for_each_host(state, lambda host: fn(host, fl)), fl


def api_models(host: Host, ctx: RigApi, timeout: int = 5) -> dict:
    """GET /v1/models from the rig itself (curl), as the recipes' health check does."""
    url = f"http://{ctx_host(ctx)}:{ctx.port}/v1/models"
    code, body = http_on_rig(host, url, timeout, api_key=ctx.settings.api_key)
    models = None
    with contextlib.suppress(ValueError, AttributeError):
        models = [m.get("id") for m in json.loads(body).get("data", [])]
    return {"url": url, "http_code": code, "models": models}


def http_on_rig(
    host: Host, url: str, timeout: int, body: dict | None = None, api_key: str | None = None
) -> tuple[int, str]:
    """(HTTP code, 0 when nothing answered; response body) of a request made by curl on the host."""
    text, _, code = sh(host, curl_command(url, api_key, timeout=timeout, body=body)).rpartition("\n")
    return (int(code) if code.strip().isdigit() else 0), text


def ctx_host(ctx: RigApi) -> str:
    """The address the rig's own API is asked at from the rig (host data serving_health_host, else 127.0.0.1)."""
    return ctx.data["serving_health_host"] or "127.0.0.1"


def curl_command(
    url: str, api_key: str | None, timeout: int, body: dict | None = None, last: str = "http_code"
) -> StringCommand:
    """curl printing the body, then the HTTP code (or curl's -w variable `last`) on a line of its own; key masked."""
    from pyinfra.api import MaskString, QuoteString, StringCommand

    parts = ["curl", "-s", "-m", str(timeout), "-w", QuoteString(f"\\n%{{{last}}}")]
    if api_key:
        parts += ["-H", MaskString(shlex.quote(f"Authorization: Bearer {api_key}"))]
    if body is not None:
        parts += ["-H", QuoteString("Content-Type: application/json"), "--data-binary", QuoteString(json.dumps(body))]
    return StringCommand(*parts, QuoteString(url))
