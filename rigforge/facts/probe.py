"""One batched probe per rig instead of one SSH round trip per fact.

pyinfra reads each fact with its own remote command (~80 ms apiece over SSH); a converged rig needs ~70 of them
(package versions and holds, hashes of managed files, unit states, GPU caps, git HEADs and dirty flags, weight
stamps), which made a no-op re-converge ~5x pyinfra's own floor. Here:

- Every fact a deploy reads on a host is recorded (fact class + arguments) and saved on the controller at the
  end of the run (`~/.cache/rigforge/probes/`, one file per host and deploy file; env RIGFORGE_PROBE_CACHE,
  `off` disables the probe; docs/probe.md).
- On the next run, the first fact read on that host runs all the recorded facts' commands in ONE remote shell
  command (each in its own subshell, with its exit code) and parses every section with the fact's own
  `process()`; operations then decide locally from that snapshot.
- The snapshot answers only while nothing has changed on the host in this run: the first command, upload or
  rsync that is not a fact read (an operation changing something) drops it, and every later read is a live, per-op
  fact read as before. So an answer from the snapshot is exactly what the live read would have returned at that
  point (facts read while pyinfra prepares describe the pre-change state just the same).
- Anything the snapshot cannot answer exactly is read live: a fact not recorded yet, a section that exited
  non-zero or whose command is missing (pyinfra's own handling then applies), other privilege arguments than
  the host's defaults, facts with preconditions or their own shell.

`read(host, requests)` is the batched read on its own: any list of (fact class, kwargs) in one remote command.
`install_all()` patches pyinfra (this probe and rigforge/speedups.py); the deploy entry calls it, importing changes
nothing. It relies on pyinfra 3.10's private `facts._get_fact`, `_make_command`, `_handle_fact_kwargs`,
`CONNECTOR_ARGUMENT_KEYS` and `Host.run_shell_command` / `put_file` / `rsync` (tests/test_probe.py checks them).
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import importlib
import json
import os
import secrets
from pathlib import Path

from pyinfra.api import StringCommand
from pyinfra.api import facts as pyinfra_facts
from pyinfra.api.arguments import auth_argument_meta
from pyinfra.api.exceptions import FactProcessError
from pyinfra.api.facts import FactBase
from pyinfra.api.host import Host

from rigforge import speedups

# Connector arguments that change what a command sees: a snapshot answer needs the same ones as the probe (how
# the command is wrapped: sudo, su, doas...; passwords aside, they never change what it sees).
IDENTITY_ARGS = (*(k for k in auth_argument_meta if not k.endswith("_password")), "_shell_executable", "_chdir", "_env")
# Host methods that can change a rig (get_file, connect and disconnect do not): each ends the snapshot's answers
CHANGING = ("run_shell_command", "put_file", "rsync")
# The connector's data that names the rig it reaches (never passwords or keys)
CONNECTOR_IDENTITY = ("ssh_hostname", "ssh_port", "ssh_user")


def cache_dir() -> Path | None:
    value = os.environ.get("RIGFORGE_PROBE_CACHE", "")
    if value.lower() in ("off", "0", "no", "false"):
        return None
    return Path(value) if value else Path.home() / ".cache" / "rigforge" / "probes"


class _HostSnapshot:
    def __init__(self, host: Host):
        self.host = host
        self.answers: dict[str, object] = {}  # request key -> processed fact value
        self.probed = False
        self.valid = True  # nothing changed on the host yet in this run
        self.reading = False  # a fact read (or the probe) is running: its commands change nothing
        self.requests: dict[str, dict] = {}  # key -> {"fact": "module:Class", "kwargs": {...}}, this run
        self.file = None
        self.connection = None
        self.probes = self.served = 0  # counters (batched remote commands, answers served), for the benchmark
        self.defaults: dict | None = None  # the host's default global arguments for facts


_SNAPSHOTS: dict[int, _HostSnapshot] = {}
_original_get_fact = None


def _of(host: Host) -> _HostSnapshot:
    snap = _SNAPSHOTS.get(id(host))
    if snap is None or snap.host is not host:
        snap = _SNAPSHOTS[id(host)] = _HostSnapshot(host)
    return snap


def _identity(global_kwargs: dict) -> str:
    return repr([(k, global_kwargs.get(k)) for k in IDENTITY_ARGS])


def fact_key(cls, fact_kwargs: dict) -> str | None:
    """The key of a fact read in `read()`'s answer (None: arguments that do not serialise, never batched)."""
    try:
        return f"{cls.__module__}:{cls.__qualname__}|" + json.dumps(fact_kwargs, sort_keys=True)
    except (TypeError, ValueError):
        return None  # arguments that do not serialise: always read live


@functools.cache
def _cacheable(cls) -> bool:
    fact = cls()
    return (
        issubclass(cls, FactBase)
        and getattr(cls, "probe", True)  # a fact may opt out (rigforge/facts/hfweights.py FileDigests)
        and not fact.shell_executable
        and type(fact).check_preconditions is FactBase.check_preconditions
    )


def _probe_file(host: Host, state) -> Path | None:
    base = cache_dir()
    if base is None:
        return None
    data = getattr(host.connector, "data", None) or {}
    ident = json.dumps(
        [
            host.name,
            type(host.connector).__name__,
            *(data.get(key) for key in CONNECTOR_IDENTITY),
            str(getattr(state, "current_deploy_filename", "") or ""),
        ],
        default=str,
    )
    return base / f"{hashlib.sha256(ident.encode()).hexdigest()[:24]}.json"


def _defaults(state, host: Host, snap: _HostSnapshot, cls) -> dict:
    """The host's default global arguments for a fact read outside an operation, computed once per host."""
    if snap.defaults is None:
        snap.defaults = pyinfra_facts._handle_fact_kwargs(state, host, cls, None, None)[1]
    return snap.defaults


def read(host: Host, requests, global_kwargs: dict | None = None) -> dict[str, object]:
    """Read the facts `requests` (an iterable of (fact class, kwargs)) on `host` in ONE remote command.

    Returns {fact_key(cls, kwargs): processed value} for each fact whose command exited 0 and whose output
    processed; the others are left out (read those with `host.get_fact`): facts with preconditions or their own
    shell, a missing required command, a failed command. `global_kwargs`: the connector arguments to run with
    (default: the host's, as for a fact read outside an operation).
    """
    marker = f"@@rigforge-probe-{secrets.token_hex(6)}"
    parts, sections = ["d=$(mktemp -d) || exit 1;"], []
    for cls, fact_kwargs in requests:
        key = fact_key(cls, fact_kwargs)
        if key is None or not _cacheable(cls):
            continue
        fact = cls()
        try:
            command = pyinfra_facts._make_command(fact.command, dict(fact_kwargs))
            requires = pyinfra_facts._make_command(fact.requires_command, dict(fact_kwargs))
        except Exception:  # noqa: BLE001 - arguments this fact no longer takes: not batched
            continue
        if command is None:
            continue
        guard = f"command -v {requires} >/dev/null 2>&1 || exit 97; " if requires else ""
        n = len(sections)
        sections.append((key, fact))
        body = command if isinstance(command, StringCommand) else StringCommand(command)
        # every fact's command in its own background subshell, so the rig runs them side by side, writing its
        # section (marker, output, marker with exit code) to its own file; one `cat` gathers them all
        parts += [f'( echo "{marker} {n}"; (', guard, body, f') 2>/dev/null </dev/null; echo "{marker} rc $?" )']
        parts += [f'>"$d/{n}" &']
    parts += ['wait; cat "$d"/*; rm -rf "$d"']
    if not sections:
        return {}
    snap = _of(host)
    if global_kwargs is None:
        global_kwargs = _defaults(host.state, host, snap, sections[0][1].__class__)
    if not host.connected:
        host.connect(reason="to read the rig in one probe", raise_exceptions=True)
    executor_kwargs = {k: v for k, v in global_kwargs.items() if k in pyinfra_facts.CONNECTOR_ARGUMENT_KEYS}
    snap.probes += 1
    was_reading, snap.reading = snap.reading, True  # the probe changes nothing on the rig
    try:
        ok, output = host.run_shell_command(
            StringCommand(*parts), print_output=False, print_input=False, **executor_kwargs
        )
    finally:
        snap.reading = was_reading
    answers: dict[str, object] = {}
    if not ok:
        return answers
    current, lines = None, []
    for line in output.stdout_lines:
        if not line.startswith(marker):
            lines.append(line)
            continue
        tail = line[len(marker) + 1 :]
        if tail.startswith("rc ") and current is not None:
            key, fact = sections[current]
            if tail == "rc 0":
                try:
                    answers[key] = fact.process(lines) if lines else fact.default()
                except (FactProcessError, ValueError, KeyError, IndexError, TypeError):
                    pass
            current = None
        elif tail.isdigit():
            current, lines = int(tail), []
    return answers


def _probe(state, host: Host, snap: _HostSnapshot, global_kwargs: dict) -> None:
    """Read every fact recorded for this host (and deploy file) in one remote command; keep the exact answers."""
    snap.probed = True
    snap.file = _probe_file(host, state)
    snap.connection = _identity(global_kwargs)
    try:
        recorded = json.loads(snap.file.read_text()) if snap.file else []
    except (OSError, ValueError):
        recorded = []
    requests = []
    for item in recorded:
        try:
            module, _, name = item["fact"].partition(":")
            requests.append((getattr(importlib.import_module(module), name), dict(item["kwargs"])))
        except Exception:  # noqa: BLE001 - a recorded fact that no longer loads is simply not probed
            continue
    snap.answers = read(host, requests, global_kwargs)


def _request(state, host, snap: _HostSnapshot, cls, args, kwargs) -> tuple[str | None, dict, dict]:
    """(snapshot key or None, fact kwargs, global kwargs) of a fact read, without pyinfra's per-read argument
    handling (type hints of every global argument: the slowest part of a read on the controller)."""
    kwargs = dict(kwargs or {})
    if args or any(k.startswith("_") for k in kwargs) or not _cacheable(cls):
        return None, kwargs, {}  # explicit global arguments or positional ones: pyinfra's own path, live
    global_kwargs = host.current_op_global_arguments  # inside an operation: its global arguments, complete
    if global_kwargs is None:  # preparing: the host's defaults, computed once
        global_kwargs = _defaults(state, host, snap, cls)
    return fact_key(cls, kwargs), kwargs, global_kwargs


def _get_fact(state, host, cls, args=None, kwargs=None, *rest, **kw):
    """pyinfra's _get_fact, answered from the host's snapshot when that is exact (see the module doc)."""
    snap = _of(host)
    key, fact_kwargs, global_kwargs = _request(state, host, snap, cls, args, kwargs)
    if key is not None:
        if not snap.probed and snap.valid:
            _probe(state, host, snap, global_kwargs)
        if snap.connection == _identity(global_kwargs):
            snap.requests.setdefault(key, {"fact": f"{cls.__module__}:{cls.__qualname__}", "kwargs": fact_kwargs})
            if snap.valid and key in snap.answers:
                snap.served += 1
                return snap.answers[key]
    snap.reading = True
    try:
        return _original_get_fact(state, host, cls, args, kwargs, *rest, **kw)
    finally:
        snap.reading = False


def _changing(method):
    def wrapper(self, *args, **kwargs):
        snap = _SNAPSHOTS.get(id(self))
        if snap is not None and snap.host is self and not snap.reading:
            snap.valid = False  # something on the host may change now: no more snapshot answers
        return method(self, *args, **kwargs)

    wrapper.__wrapped__ = method
    return wrapper


def _save() -> None:
    for snap in list(_SNAPSHOTS.values()):
        if not snap.file or not snap.requests:
            continue
        try:
            snap.file.parent.mkdir(parents=True, exist_ok=True)
            tmp = snap.file.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(list(snap.requests.values())))
            tmp.replace(snap.file)
        except OSError:
            pass


def install() -> None:
    """Answer fact reads from one batched probe per host (idempotent; a no-op when RIGFORGE_PROBE_CACHE=off)."""
    global _original_get_fact
    if _original_get_fact is not None or cache_dir() is None:
        return
    _original_get_fact = pyinfra_facts._get_fact
    pyinfra_facts._get_fact = _get_fact
    for name in CHANGING:
        setattr(Host, name, _changing(getattr(Host, name)))
    atexit.unregister(_save)  # once, however often installed
    atexit.register(_save)


def install_all() -> None:
    """Everything rigforge patches in pyinfra for a deploy: this probe and rigforge/speedups.py. Called first thing
    by the deploy entry (roles/site.py `provision`); importing rigforge changes nothing in pyinfra."""
    install()
    speedups.install()
