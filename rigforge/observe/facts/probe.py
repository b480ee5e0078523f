"""One batched probe per rig instead of one SSH round trip per fact (docs/probe.md: what it batches, when an
answer is used, where the cache lives).

Every fact a deploy reads on a host is recorded (fact class + arguments) and saved on the controller at the end of
the run; the next run's first fact read runs them all in ONE remote command (or the rig's lock holder does, once it
holds the lock: `lock_request`), parsed with each fact's own `process()`. The snapshot answers only until the first
command, upload or rsync that is not a fact read, so an answer from it is exactly what the live read would have
returned; anything it cannot answer exactly is read live.

`read(host, requests)` is the batched read on its own. `install_all()` patches pyinfra (the deploy's first step calls
it; importing changes nothing). It relies on pyinfra 3.10's private `facts._get_fact` (replaced: `get_fact` calls it
by that name), `_make_command`, `_handle_fact_kwargs`, `CONNECTOR_ARGUMENT_KEYS`, `Host.run_shell_command` /
`put_file` / `rsync` (wrapped) and `Host.current_op_global_arguments` (tests/test_probe.py checks them).
"""

import atexit
import contextlib
import functools
import hashlib
import importlib
import json
import os
import secrets
import shlex
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from pyinfra.api import StringCommand
from pyinfra.api import facts as pyinfra_facts
from pyinfra.api.arguments import auth_argument_meta
from pyinfra.api.exceptions import FactProcessError
from pyinfra.api.facts import FactBase
from pyinfra.api.host import Host
from pyinfra.api.state import State
from pyinfra.context import ctx_state
from pyinfra.facts import files as pyinfra_files

from rigforge import speedups
from rigforge.observe import inventory

# Connector arguments that change what a command sees: a snapshot answer needs the same ones as the probe (how
# the command is wrapped: sudo, su, doas...; passwords aside, they never change what it sees).
IDENTITY_ARGS = (*(k for k in auth_argument_meta if not k.endswith("_password")), "_shell_executable", "_chdir", "_env")
# Host methods that can change a rig (get_file, connect and disconnect do not): each ends the snapshot's answers
CHANGING = ("run_shell_command", "put_file", "rsync")
# The connector's data that names the rig it reaches (never passwords or keys)
CONNECTOR_IDENTITY = ("ssh_hostname", "ssh_port", "ssh_user")
# what a probe is asked for: (fact class, its arguments) pairs
Requests = Iterable[tuple[type[FactBase], dict]]
R = TypeVar("R")


def cache_dir() -> Path | None:
    """Where probes are recorded: RIGFORGE_PROBE_CACHE, else ~/.cache/rigforge/probes; None: the probe is off."""
    value = os.environ.get("RIGFORGE_PROBE_CACHE", "")
    if value.lower() in ("off", "0", "no", "false"):
        return None
    return Path(value) if value else Path.home() / ".cache" / "rigforge" / "probes"


class _HostSnapshot:
    """One host's probe in this run: its answers, the facts read (recorded at exit) and whether answers still hold."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self.answers: dict[str, object] = {}  # request key -> processed fact value
        self.requests: dict[str, dict] = {}  # key -> {"fact": "module:Class", "kwargs": {...}}, this run's reads
        self.probed = False  # the recorded facts were asked for (read, or sent with the rig's lock)
        self.valid = True  # nothing changed on the host yet in this run
        self.reading = False  # a fact read (or the probe) is running: its commands change nothing
        self.file: Path | None = None  # the probe's cache file (`_probe_file`; None: the probe is off)
        self.connection: str | None = None  # the connector arguments its answers are for (`_identity`)
        self.pending: tuple | None = None  # (sections, marker, then) of the probe sent with the rig's lock, unread
        self.probes = 0  # batched remote commands, for the benchmark
        self.served = 0  # answers served from the snapshot, for the benchmark

    @functools.cached_property
    def defaults(self) -> dict:
        """The host's default global arguments for a fact read outside an operation."""
        return pyinfra_facts._handle_fact_kwargs(self.host.state, self.host, FactBase, None, None)[1]


_SNAPSHOTS: dict[int, _HostSnapshot] = {}
_original_get_fact = None


def _of(host: Host) -> _HostSnapshot:
    """The host's snapshot, made at its first use (a new one for a new Host at a reused id)."""
    snap = _SNAPSHOTS.get(id(host))
    if snap is None or snap.host is not host:
        snap = _SNAPSHOTS[id(host)] = _HostSnapshot(host)
    return snap


def _identity(global_kwargs: dict) -> str:
    """The connector arguments (IDENTITY_ARGS) that change what a command sees, as one comparable text."""
    return repr([(k, global_kwargs.get(k)) for k in IDENTITY_ARGS])


def fact_key(cls: type[FactBase], fact_kwargs: dict) -> str | None:
    """The key of a fact read in `read()`'s answer (None: arguments that do not serialise, always read live)."""
    try:
        return f"{cls.__module__}:{cls.__qualname__}|" + json.dumps(fact_kwargs, sort_keys=True)
    except (TypeError, ValueError):
        return None


@functools.cache
def _cacheable(cls: type) -> bool:
    """Whether the probe may answer reads of `cls`: a fact, not opted out, no shell of its own, no preconditions."""
    return (
        issubclass(cls, FactBase)
        and getattr(cls, "probe", True)  # a fact may opt out (rigforge/observe/facts/hfweights.py FileDigests)
        and not cls().shell_executable
        and cls.check_preconditions is FactBase.check_preconditions
    )


# pyinfra's file facts whose commands are one `stat` or one hash of a path: the probe runs one `stat` and one
# sha1sum/sha256sum for all their paths (not one process each); class -> "stat" or the hash's hex digits
FILE_FACTS = {
    pyinfra_files.File: "stat",
    pyinfra_files.Directory: "stat",
    pyinfra_files.Link: "stat",
    pyinfra_files.Sha1File: 40,
    pyinfra_files.Sha256File: 64,
}
_HASHERS = {40: "sha1sum", 64: "sha256sum"}
# what a fact's process() raises on output it cannot read: that answer is left out (read live)
_PROCESS_ERRORS = (FactProcessError, ValueError, KeyError, IndexError, TypeError)


def _file_path(cls: type[FactBase], fact_kwargs: dict) -> str | None:
    """The path of a file fact the probe reads in its one `stat` or hash (a FILE_FACTS class whose one argument is an
    absolute path with no backslash or newline); None: the fact runs its own command."""
    path = fact_kwargs.get("path") if cls in FILE_FACTS and list(fact_kwargs) == ["path"] else None
    plain = isinstance(path, str) and path.startswith("/") and not any(c in path for c in "\\\n")
    return path if plain else None


def _files_command(marker: str, paths: dict[str, set]) -> str:
    """One background job for all batched file facts (`paths`: path -> its kinds): `e PATH` (exists), `l PATH` (a
    symlink to nothing), `s PATH` and its line of pyinfra's `stat` format, and sha1sum's and sha256sum's lines."""

    def quoted(kind: str | int | None) -> str:
        return " ".join(shlex.quote(path) for path, kinds in paths.items() if kind is None or kind in kinds)

    stat = "s %n\\n" + pyinfra_files.LINUX_STAT_COMMAND.removeprefix("stat -c '").removesuffix("'") + "\\n"
    tools = {"stat": f"stat --printf {shlex.quote(stat)}", **_HASHERS}
    runs = [f"{tool} -- {quoted(kind)}; " for kind, tool in tools.items() if quoted(kind)]
    return (
        f'( echo "{marker} files"; for p in {quoted(None)}; do if test -e "$p"; then echo "e $p"; '
        f'elif test -L "$p"; then echo "l $p"; fi; done; {"".join(runs)}'
        f'echo "{marker} rc 0" ) 2>/dev/null </dev/null >"$d/files" &'
    )


def _file_answers(block: list[str], batched: list, answers: dict) -> None:
    """Each batched file fact's answer from the files job's lines (a missing path: its default; no line: read live)."""
    exists: set[str] = set()  # the paths that exist
    links: set[str] = set()  # the paths that are symlinks to nothing
    found: dict[tuple[str | int, str], str | None] = {}  # (kind, path) -> its line
    lines = iter(block)
    for line in lines:
        if line.startswith("e "):
            exists.add(line[2:])
        elif line.startswith("l "):
            links.add(line[2:])
        elif line.startswith("s "):
            found[("stat", line[2:])] = next(lines, None)
        else:
            digest, _, path = line.partition("  ")
            if len(digest) in _HASHERS and all(c in "0123456789abcdefABCDEF" for c in digest):
                found[(len(digest), path)] = line
    for key, fact, path in batched:
        kind = FILE_FACTS[type(fact)]
        present = path in exists or (kind == "stat" and path in links)
        out = found.get((kind, path))
        if present and out is None:
            continue
        with contextlib.suppress(*_PROCESS_ERRORS):
            answers[key] = fact.process([out]) if present else fact.default()


def script(requests: Requests, marker: str) -> tuple[StringCommand | None, list[tuple[str, FactBase, str | None]]]:
    """The one remote command that reads `requests`, and its sections by number: (key, fact, path if read in the
    files job). Each fact runs in a background subshell whose EXIT trap prints its exit code (a command with its own
    trap or `exec` loses it: read live); a `shared` sub-command runs once and is replayed (`_r N`) to each."""
    parts, sections, shared, dependent, paths = [], [], {}, [], {}
    for cls, fact_kwargs in requests:
        key = fact_key(cls, fact_kwargs)
        if key is None or not _cacheable(cls):
            continue
        fact = cls()
        path = _file_path(cls, fact_kwargs)
        if path is not None:  # the files job reads it: a stat fact's own command is not built
            if FILE_FACTS[cls] != "stat":
                fact.command(path)  # a hash fact's process() matches the path its command keeps
            sections.append((key, fact, path))
            paths.setdefault(path, set()).add(FILE_FACTS[cls])
            continue
        try:
            command = pyinfra_facts._make_command(fact.command, dict(fact_kwargs))
            requires = pyinfra_facts._make_command(fact.requires_command, dict(fact_kwargs))
        except Exception:  # noqa: BLE001 - arguments this fact no longer takes: not batched
            continue
        if command is None:
            continue
        guard = f"command -v {requires} >/dev/null 2>&1 || exit 97; " if requires else ""
        n = len(sections)
        sections.append((key, fact, None))
        raw = command.get_raw_value() if isinstance(command, StringCommand) else command
        uses = [text for text in getattr(cls, "shared", ()) if text in raw]
        for text in uses:
            raw = raw.replace(text, f"_r {shared.setdefault(text, len(shared))}")
        # one subshell per section: its exit code (an `exit` in the command's included) is printed by its EXIT trap
        section = [f'( trap \'echo "{marker} rc $?"\' EXIT; echo "{marker} {n}";', guard, raw, ")"]
        (dependent if uses else parts).append([*section, f'>"$d/{n}" 2>/dev/null </dev/null' + (";" if uses else " &")])
    if not sections:
        return None, []
    head = ["d=$(mktemp -d) || exit 1;"]
    if shared:
        # a shared sub-command's stdout, stderr and exit code, replayed (dot files: not gathered as sections)
        head.append('_r() { cat "$d/.$1.out"; cat "$d/.$1.err" >&2; read -r _c <"$d/.$1.rc"; return "$_c"; };')
        runs = [
            f'( ( {text} ) >"$d/.{i}.out" 2>"$d/.{i}.err" </dev/null; echo $? >"$d/.{i}.rc" ) &'
            for text, i in shared.items()
        ]
        head += ["{", *runs, "wait;", *(p for section in dependent for p in section), "} &"]
    if paths:
        head.append(_files_command(marker, paths))
    return StringCommand(*head, *(p for section in parts for p in section), 'wait; cat "$d"/*; rm -rf "$d"'), sections


def parse(lines: Iterable[str], sections: list[tuple[str, FactBase, str | None]], marker: str) -> dict[str, object]:
    """{key: processed value} for each section of `script(requests, marker)`'s output that exited 0 and processed."""
    answers: dict[str, object] = {}
    current, collected = None, []
    for line in lines:
        if not line.startswith(marker):
            collected.append(line)
            continue
        tail = line[len(marker) + 1 :]
        if tail.startswith("rc "):
            if current == "files":
                _file_answers(collected, [section for section in sections if section[2] is not None], answers)
            elif current is not None and tail == "rc 0":
                key, fact, _ = sections[current]
                with contextlib.suppress(*_PROCESS_ERRORS):
                    answers[key] = fact.process(collected) if collected else fact.default()
            current = None
        elif tail.isdigit() or tail == "files":
            current, collected = int(tail) if tail.isdigit() else tail, []
    return answers


def read(host: Host, requests: Requests, global_kwargs: dict | None = None) -> dict[str, object]:
    """Read the facts `requests` ((fact class, kwargs) pairs) on `host` in ONE remote command.

    Returns {fact_key(cls, kwargs): processed value} for each fact whose command exited 0 and whose output processed;
    the others (arguments that are not JSON, preconditions, own shell, opted out, missing required command, failed)
    are left out, to read with `host.get_fact`. `global_kwargs`: the connector arguments (default: the host's, as
    outside an operation)."""
    marker = f"@@rigforge-probe-{secrets.token_hex(6)}"
    command, sections = script(requests, marker)
    if command is None:
        return {}
    snap = _of(host)
    if not host.connected:
        host.connect(reason="to read the rig in one probe", raise_exceptions=True)
    global_kwargs = global_kwargs or snap.defaults
    executor_kwargs = {k: v for k, v in global_kwargs.items() if k in pyinfra_facts.CONNECTOR_ARGUMENT_KEYS}
    snap.probes += 1
    was_reading, snap.reading = snap.reading, True  # the probe changes nothing on the rig
    try:
        ok, output = host.run_shell_command(command, print_output=False, print_input=False, **executor_kwargs)
    finally:
        snap.reading = was_reading
    return parse(output.stdout_lines, sections, marker) if ok else {}


def _probe_file(host: Host, state: State) -> Path | None:
    """The cache file of `host`'s probe for this run's deploy file, named by a hash of the host's name, its connector
    and the connector's CONNECTOR_IDENTITY (never host data), and the deploy file; None: the probe is off."""
    base = cache_dir()
    if base is None:
        return None
    data = getattr(host.connector, "data", None) or {}
    deploy = str(getattr(state, "current_deploy_filename", "") or "")
    ident = [host.name, type(host.connector).__name__, *(data.get(key) for key in CONNECTOR_IDENTITY), deploy]
    digest = hashlib.sha256(json.dumps(ident, default=str).encode()).hexdigest()[:24]
    return base / f"{digest}.json"


def _recorded(state: State, host: Host, snap: _HostSnapshot, global_kwargs: dict) -> list[tuple[type[FactBase], dict]]:
    """The facts recorded for this host (and deploy file) in its cache file, as requests; marks the snapshot probed."""
    snap.probed = True
    snap.file = _probe_file(host, state)
    snap.connection = _identity(global_kwargs)
    recorded, requests = [], []
    with contextlib.suppress(OSError, ValueError):
        recorded = json.loads(snap.file.read_text()) if snap.file else []
    for item in recorded:
        with contextlib.suppress(Exception):  # a recorded fact that no longer loads is simply not probed
            module, _, name = item["fact"].partition(":")
            requests.append((getattr(importlib.import_module(module), name), dict(item["kwargs"])))
    return requests


# connector arguments the lock's channel does not reproduce (a PTY, stdin, a timeout, passwords): probe on its own
_UNFOLDED = ("_get_pty", "_stdin", "_timeout", "_sudo_password", "_su_password", "_doas_password")


def lock_request(host: Host) -> list | None:
    """This host's probe, run by the rig's lock holder once it holds the lock (roles/rig_lock.py `send`), on the
    same connection: [command as pyinfra would wrap it, end line, None (the lines printed before the end line, filled
    in by the lock; `lock_answer` reads them)]. None (probe on its own later) when the probe is off, already asked
    for, or the connector arguments ask for what the lock's channel does not do (`_UNFOLDED`)."""
    snap = _of(host)
    if _original_get_fact is None or snap.probed or not snap.valid or host.current_op_global_arguments is not None:
        return None
    from pyinfra.connectors.util import make_unix_command_for_host

    executor_kwargs = {k: v for k, v in snap.defaults.items() if k in pyinfra_facts.CONNECTOR_ARGUMENT_KEYS}
    if any(executor_kwargs.get(k) for k in _UNFOLDED) or host.connector_data.get("prompted_sudo_password"):
        return None
    marker = f"@@rigforge-probe-{secrets.token_hex(6)}"
    command, sections = script(_recorded(host.state, host, snap, snap.defaults), marker)
    if command is None:
        return None
    wrap = {k: v for k, v in executor_kwargs.items() if k not in ("_success_exit_codes", *_UNFOLDED[:3])}
    snap.probes += 1
    then = [make_unix_command_for_host(host.state, host, command, **wrap).get_raw_value(), f"{marker} end", None]
    snap.pending = (sections, marker, then)
    return then


def lock_answer(host: Host) -> None:
    """Keep the answers of `lock_request`'s probe; when it did not run (no lock taken), probe at the first read."""
    snap = _of(host)
    if snap.pending is None:
        return
    (sections, marker, (_, _, lines)), snap.pending = snap.pending, None
    if lines is None:
        snap.probed, snap.probes = False, snap.probes - 1
    elif lines[-1:] == ["0"]:  # the probe ran and exited 0 (its exit code: the last line)
        snap.answers = parse(lines[:-1], sections, marker)


def _get_fact(
    state: State,
    host: Host,
    cls: type[FactBase],
    args: list | None = None,
    kwargs: dict | None = None,
    *rest: Any,
    **kw: Any,
) -> Any:
    """pyinfra's _get_fact, answered from the host's snapshot when exact, skipping pyinfra's (slow) per-read argument
    handling; explicit global or positional arguments: pyinfra's own path, live."""
    snap = _of(host)
    fact_kwargs = dict(kwargs or {})
    if not args and not any(k.startswith("_") for k in fact_kwargs) and _cacheable(cls):
        # inside an operation: its global arguments, complete; preparing: the host's defaults, computed once
        global_kwargs = host.current_op_global_arguments or snap.defaults
        if (key := fact_key(cls, fact_kwargs)) is not None:
            if not snap.probed and snap.valid:  # every fact recorded for this host, in one remote command
                snap.answers = read(host, _recorded(state, host, snap, global_kwargs), global_kwargs)
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


def _changing(method: Callable[..., R]) -> Callable[..., R]:
    """`method` of Host (CHANGING), ending the host's snapshot answers when it runs outside a fact read."""

    def wrapper(self: Host, *args: Any, **kwargs: Any) -> R:
        snap = _SNAPSHOTS.get(id(self))
        if snap is not None and snap.host is self and not snap.reading:
            snap.valid = False  # something on the host may change now: no more snapshot answers
        return method(self, *args, **kwargs)

    wrapper.__wrapped__ = method
    return wrapper


def _save() -> None:
    """Record each host's fact reads in its cache file (at exit), for the next run's probe."""
    for snap in [snap for snap in _SNAPSHOTS.values() if snap.file and snap.requests]:
        with contextlib.suppress(OSError):
            snap.file.parent.mkdir(parents=True, exist_ok=True)
            tmp = snap.file.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(list(snap.requests.values())))
            tmp.replace(snap.file)


def install_all() -> None:
    """Everything rigforge patches in pyinfra for a deploy (the deploy files' first step, roles/rig_lock.py
    `ask_first`, and roles/site.py `start` call it), idempotent: the batched probe, rigforge/speedups.py, and no
    delayed ACKs on the SSH connections (rigforge/observe/inventory.py `quick_connections`).

    With RIGFORGE_PROBE_CACHE=off (`cache_dir`) the probe is not installed: every fact is read live with its own
    command, as in plain pyinfra, nothing is recorded, and the rig's lock carries no probe; the rest still is."""
    global _original_get_fact
    if _original_get_fact is None and cache_dir() is not None:
        _original_get_fact = pyinfra_facts._get_fact
        pyinfra_facts._get_fact = _get_fact
        for name in CHANGING:
            setattr(Host, name, _changing(getattr(Host, name)))
        atexit.unregister(_save)  # once, however often installed
        atexit.register(_save)
    speedups.install()
    inventory.quick_connections(ctx_state.get().inventory if ctx_state.isset() else ())
