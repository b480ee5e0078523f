"""Tier 1: the batched probe (rigforge/observe/facts/probe.py) on pyinfra's @local connector, no root, no rigs.

- After a recording run, the next run reads every fact in ONE command and serves them all: the batched path is
  taken (it fails when the probe is not installed);
- a change to the host (a command, an upload, an rsync) ends the answers from the probe;
- `read()` batches any list of facts;
- the deploy entry installs the probe and importing roles.site changes nothing;
- the private pyinfra names and signatures the probe and rigforge/speedups.py rely on are still there.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import inspect
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pyinfra.api import Config, Inventory, State, arguments, util
from pyinfra.api import facts as pyinfra_facts
from pyinfra.api.facts import FactBase
from pyinfra.api.host import Host
from pyinfra.connectors.local import LocalConnector
from pyinfra.connectors.ssh import SSHConnector
from pyinfra.connectors.util import CommandOutput
from pyinfra.facts.files import File
from pyinfra.facts.server import Command

from rigforge import speedups
from rigforge.observe.facts import probe


@pytest.fixture
def shipped(monkeypatch, tmp_path):
    """pyinfra as shipped, the probe's cache in tmp_path; whatever was patched before is restored after."""
    monkeypatch.setenv("RIGFORGE_PROBE_CACHE", str(tmp_path / "probes"))
    monkeypatch.setattr(pyinfra_facts, "_get_fact", probe._original_get_fact or pyinfra_facts._get_fact)
    for name in probe.CHANGING:
        monkeypatch.setattr(Host, name, inspect.unwrap(getattr(Host, name)))
    for module in (util, sys.modules["pyinfra.api.operation"]):
        monkeypatch.setattr(module, "get_operation_order_from_stack", speedups._SHIPPED_ORDER)
    monkeypatch.setattr(sys.modules["pyinfra.api.operation"], "signature", inspect.signature)
    monkeypatch.setattr(arguments, "all_global_arguments", speedups._ORIGINAL)
    monkeypatch.setattr(pyinfra_facts, "all_global_arguments", speedups._ORIGINAL)
    monkeypatch.setattr(probe, "_original_get_fact", None)
    monkeypatch.setattr(probe, "_SNAPSHOTS", {})
    monkeypatch.setattr(SSHConnector, "connect", inspect.unwrap(SSHConnector.connect))
    for name in speedups._CALLERS:
        monkeypatch.setattr(sys.modules[name], "pop_global_arguments", speedups._SHIPPED_POP)
    return tmp_path


def _requests(tmp_path) -> list:
    (tmp_path / "f").write_text("x")
    return [
        (Command, {"command": "echo one"}),
        (Command, {"command": "printf 'a\\nb\\n'"}),
        (File, {"path": str(tmp_path / "f")}),
        (File, {"path": str(tmp_path / "absent")}),
    ]


def _host(monkeypatch) -> tuple[Host, list]:
    """A fresh @local host (a new pyinfra run); the list gets every command that reaches the host."""
    inventory = Inventory((["@local"], {}))
    state = State(inventory, Config())
    state.current_deploy_filename = "deploy/probe_test.py"
    host = inventory.get_host("@local")
    commands: list = []
    run = LocalConnector.run_shell_command

    def counted(self, command, *args, **kwargs):
        commands.append(str(command))
        return run(self, command, *args, **kwargs)

    monkeypatch.setattr(LocalConnector, "run_shell_command", counted)
    return host, commands


def _read_all(host, requests) -> list:
    return [host.get_fact(cls, **kwargs) for cls, kwargs in requests]


def test_second_run_reads_every_fact_in_one_probe(shipped, monkeypatch):
    requests = _requests(shipped)
    probe.install_all()
    host, commands = _host(monkeypatch)
    live = _read_all(host, requests)  # recording run: nothing recorded yet, every read live
    snap = probe._of(host)
    assert (snap.probes, snap.served, len(commands)) == (0, 0, len(requests))
    probe._save()  # at exit in a real run
    (saved,) = (shipped / "probes").iterdir()
    assert [item["kwargs"] for item in json.loads(saved.read_text())] == [kwargs for _, kwargs in requests]

    host, commands = _host(monkeypatch)  # the next run
    assert _read_all(host, requests) == live
    snap = probe._of(host)
    assert snap.probes == 1 and snap.served == len(requests) > 0
    assert len(commands) == 1  # the probe, and no live read


class _Channel:
    """A paramiko session channel that runs its command on this machine (sh), for roles/rig_lock.py."""

    def exec_command(self, command):
        self.proc = subprocess.Popen(["sh", "-c", command], stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def recv(self, n):
        return os.read(self.proc.stdout.fileno(), n)

    def close(self):
        self.proc.stdin.close()  # the holder's `cat` ends: the lock is freed
        self.proc.wait(timeout=30)


def _with_lock(host, take):
    """`take(then)` (roles/rig_lock.py) with this host's probe as `then`, its answers kept; returns what `take`
    returns (as the deploy entry does, roles/site.py)."""
    result = take(probe.lock_request(host))
    probe.lock_answer(host)
    return result


def test_the_lock_holder_runs_the_probe_once_it_holds_the_lock(shipped, monkeypatch):
    """The deploy entry takes the rig's lock and reads the rig in one round trip: the holder runs the probe as
    pyinfra would (same answers), and no other command reaches the host; a second holder finds the lock busy."""
    from types import SimpleNamespace

    from roles import rig_lock

    requests = _requests(shipped)
    probe.install_all()
    host, _ = _host(monkeypatch)
    live = _read_all(host, requests)
    probe._save()
    host, commands = _host(monkeypatch)  # the next run
    channel = _Channel()
    host.connector.client = SimpleNamespace(get_transport=lambda: SimpleNamespace(open_session=lambda: channel))
    monkeypatch.setattr(rig_lock, "_HELD", {})
    lock = str(shipped / "rig.lock")
    assert _with_lock(host, lambda then: rig_lock.send(host, lock, False, then) or rig_lock.take(host)) == (None, None)
    try:
        assert _read_all(host, requests) == live and commands == []  # all served: no round trip but the lock's
        assert (probe._of(host).probes, probe._of(host).served) == (1, len(requests))
        other, _ = _host(monkeypatch)  # another run, on the same host name
        monkeypatch.setattr(rig_lock, "_HELD", {})
        other.connector.client = SimpleNamespace(get_transport=lambda: SimpleNamespace(open_session=_Channel))
        busy, _ = _with_lock(other, lambda then: rig_lock.send(other, lock, False, then) or rig_lock.take(other))
        assert "is being provisioned by" in busy and not probe._of(other).probed  # refused: it probes nothing
    finally:
        channel.close()


def test_every_hosts_lock_is_asked_for_before_any_answer_is_read(tmp_path, monkeypatch):
    """A lock asked for (rig_lock.send) is taken and its probe run before the controller reads the answer
    (rig_lock.take): two hosts' holders both hold their locks and have run their probes, no answer read yet."""
    import time
    from types import SimpleNamespace

    from roles import rig_lock

    monkeypatch.setattr(rig_lock, "_HELD", {})
    monkeypatch.setattr(rig_lock, "_SENT", {})
    ran = tmp_path / "probes-ran"
    client = SimpleNamespace(get_transport=lambda: SimpleNamespace(open_session=_Channel))
    hosts = [SimpleNamespace(name=name, connector=SimpleNamespace(client=client)) for name in ("rig1", "rig2")]
    thens = {h.name: [f"echo {h.name} >> {ran}; echo probed {h.name}", "@@end", None] for h in hosts}
    try:
        for h in hosts:
            rig_lock.send(h, str(tmp_path / f"{h.name}.lock"), False, thens[h.name])
        for _ in range(200):  # both holders hold their locks and have run their probes, no answer read yet
            if ran.exists() and len(ran.read_text().split()) == 2:
                break
            time.sleep(0.05)
        assert sorted(ran.read_text().split()) == ["rig1", "rig2"]
        assert [then[2] for then in thens.values()] == [None, None] and all(map(rig_lock.asked, hosts))
        for h in hosts:
            assert rig_lock.take(h) == (None, None)
            assert thens[h.name][2] == [f"probed {h.name}", "0"]
    finally:
        rig_lock._release()


def test_without_install_every_read_is_live(shipped, monkeypatch):
    """The counterpart of the test above: the same runs without install_all() make one command per read."""
    requests = _requests(shipped)
    for _ in range(2):
        host, commands = _host(monkeypatch)
        _read_all(host, requests)
        probe._save()
    assert len(commands) == len(requests) and probe._of(host).probes == 0


@pytest.mark.parametrize("method", probe.CHANGING)
def test_a_change_on_the_host_ends_the_probes_answers(shipped, monkeypatch, method):
    requests = _requests(shipped)
    probe.install_all()
    host, _ = _host(monkeypatch)
    _read_all(host, requests)
    probe._save()
    host, commands = _host(monkeypatch)
    assert host.get_fact(Command, command="echo one") == "one" and len(commands) == 1  # the probe
    assert (probe._of(host).probes, probe._of(host).served) == (1, 1)
    done = (True, CommandOutput([])) if method == "run_shell_command" else True
    setattr(host.connector, method, lambda *args, **kwargs: done)  # what the connector would do, for this call
    getattr(host, method)("x", "/y")  # an operation changes the host
    delattr(host.connector, method)
    served = probe._of(host).served
    assert host.get_fact(Command, command="printf 'a\\nb\\n'") == "a\nb"
    assert probe._of(host).served == served and len(commands) == 2  # read live after the change


def test_read_batches_any_facts_in_one_command(shipped, monkeypatch):
    requests = _requests(shipped)
    host, commands = _host(monkeypatch)
    answers = probe.read(host, [*requests, (Command, {"command": "exit 3"})])
    assert len(commands) == 1
    expected = {probe.fact_key(cls, kwargs): host.get_fact(cls, **kwargs) for cls, kwargs in requests}
    assert answers == expected  # the failed command is left out: read it live
    assert probe.read(host, []) == {} and len(commands) == 1 + len(requests)


def test_file_facts_are_read_in_one_stat_and_one_hash_each_as_their_own_commands_would(shipped, monkeypatch):
    """pyinfra's File/Directory/Link and Sha1File/Sha256File facts: one `stat` and one hash per algorithm for all
    their paths, each answer what the fact's own command gives (files, directories, links, a dangling link,
    missing paths, a space in a name); a hashed directory (its own command prints nothing) is read live, a name
    with a newline gets its own section."""
    import os
    import time

    from pyinfra.facts.files import Directory, Link, Sha1File, Sha256File

    tmp = shipped
    (tmp / "f").write_text("x")
    (tmp / "a b").write_text("y")
    (tmp / "new\nline").write_text("z")
    (tmp / "d").mkdir()
    (tmp / "l").symlink_to(tmp / "f")
    (tmp / "dangling").symlink_to(tmp / "nowhere")
    now = time.time()
    for name in ("f", "a b", "new\nline", "d"):
        os.utime(tmp / name, (now - 10, now - 20))  # atime after mtime: reading a file changes nothing it reports
    names = ["f", "a b", "new\nline", "d", "l", "dangling", "absent"]
    requests = [(cls, {"path": str(tmp / n)}) for cls in (File, Directory, Link, Sha1File, Sha256File) for n in names]
    host, commands = _host(monkeypatch)
    answers = probe.read(host, requests)
    assert len(commands) == 1
    assert commands[0].count("stat --printf") == 1 and commands[0].count("sha1sum --") == 1
    assert commands[0].count("sha256sum --") == 1
    live = {probe.fact_key(cls, kwargs): host.get_fact(cls, **kwargs) for cls, kwargs in requests}

    def same(value):  # a hash read the file after the stat: its atime moved (tmpfs), the rest is the same
        return {k: v for k, v in value.items() if k != "atime"} if isinstance(value, dict) else value

    assert {key: same(live[key]) for key in answers} == {key: same(value) for key, value in answers.items()}
    left = {
        key.partition("|")[0].rpartition(":")[2] + " " + key.rpartition("/")[2][:-2]
        for key in live
        if key not in answers
    }
    assert left == {"Sha1File d", "Sha256File d"}
    assert answers[probe.fact_key(File, {"path": str(tmp / "f")})]["size"] == 1
    assert answers[probe.fact_key(Link, {"path": str(tmp / "dangling")})]["link_target"] == str(tmp / "nowhere")
    assert answers[probe.fact_key(File, {"path": str(tmp / "absent")})] is None
    assert answers[probe.fact_key(File, {"path": str(tmp / "d")})] is False


def test_a_shared_sub_command_runs_once_and_each_fact_sees_its_output(shipped, monkeypatch, tmp_path):
    """Facts that declare a sub-command in `shared` (nvidia-smi's GPU query) get its output, stderr and exit code
    replayed where their command ran it: the same answers, one run."""
    from rigforge.observe.facts.nvidia import SMI_QUERY, BootCaps, NvidiaGpus, NvidiaSmiStatus

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(
        f"#!/bin/sh\necho run >> {tmp_path}/runs\n"
        "echo '0, GPU-a, RTX 3090, 00000000:01:00.0, 24576, 1, 230.00, 350.00, 100.00, 350.00, Enabled, 580.95.05, "
        "8.6'\n"
    )
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    requests = [(NvidiaGpus, {}), (NvidiaSmiStatus, {}), (BootCaps, {"units": ""})]
    host, commands = _host(monkeypatch)
    answers = probe.read(host, requests)
    assert (tmp_path / "runs").read_text() == "run\n" and commands[0].count(SMI_QUERY) == 1
    (tmp_path / "runs").unlink()
    live = {probe.fact_key(cls, kwargs): host.get_fact(cls, **kwargs) for cls, kwargs in requests}
    assert (tmp_path / "runs").read_text() == "run\n" * 3
    assert answers == live
    assert answers[probe.fact_key(NvidiaSmiStatus, {})] == {"installed": True, "ok": True, "message": ""}
    assert answers[probe.fact_key(BootCaps, {"units": ""})]["caps"] == {0: 230.0}


def test_cache_file_is_named_from_connector_data_not_host_data():
    state = State(Inventory((["rig1"], {})), Config())
    host = state.inventory.get_host("rig1")
    other = State(Inventory(([("rig1", {"ssh_port": 2222})], {})), Config()).inventory.get_host("rig1")
    assert isinstance(host.connector, SSHConnector)
    assert probe._probe_file(host, state) != probe._probe_file(other, state)
    assert "host.data" not in inspect.getsource(probe)


def test_the_deploy_entry_installs_and_importing_changes_nothing(shipped, monkeypatch):
    from roles import site

    assert pyinfra_facts._get_fact is not probe._get_fact
    monkeypatch.setattr(site.rig_lock, "ask", lambda h: None)  # no rig to lock here
    monkeypatch.setattr(site, "the_fleet", lambda *args: None)  # no inventory on this bare host
    monkeypatch.setattr(site, "hold_the_rig", lambda: True)
    monkeypatch.setattr(site, "front_and_watch_the_fleet", lambda *args: True)  # no inventory groups on this bare host
    monkeypatch.setattr(site, "serve_the_registry", lambda *args: True)
    monkeypatch.setattr(site, "is_rig", lambda h: True)
    monkeypatch.setattr(site, "prepare", lambda *args, **kwargs: None)  # a refused host: provision returns
    site.provision._inner(None)
    assert pyinfra_facts._get_fact is probe._get_fact
    assert all(getattr(Host, name).__wrapped__ for name in probe.CHANGING)
    assert util.get_operation_order_from_stack is speedups.operation_order
    assert hasattr(arguments.all_global_arguments, "cache_info")
    assert arguments.pop_global_arguments is speedups.pop_global_arguments
    assert SSHConnector.connect.__wrapped__  # no delayed ACKs on each SSH connection from now on
    names = "f._get_fact, h.Host.run_shell_command, h.Host.put_file, h.Host.rsync, u.get_operation_order_from_stack"
    names += ", a.all_global_arguments, a.pop_global_arguments, s.SSHConnector.connect"
    code = (
        "import pyinfra.api.facts as f, pyinfra.api.host as h, pyinfra.api.util as u, pyinfra.api.arguments as a\n"
        "import pyinfra.connectors.ssh as s\n"
        f"before = ({names})\nimport roles.site, roles.rig_lock\nraise SystemExit(0 if before == ({names}) else 1)\n"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# --- the private pyinfra names the probe and the speedups rely on ------------------------------------------


def _params(func) -> list[str]:
    return list(inspect.signature(func).parameters)


def test_pyinfra_is_the_pinned_minor():
    assert importlib.metadata.version("pyinfra").startswith("3.10.")


def test_private_pyinfra_names_and_signatures_are_as_expected():
    f = pyinfra_facts
    get_fact = ["state", "host", "cls", "args", "kwargs", "ensure_hosts", "apply_failed_hosts"]
    shipped_get_fact = probe._original_get_fact or f._get_fact  # pyinfra's, also when the probe is installed
    assert _params(shipped_get_fact) == get_fact and _params(f.get_fact) == get_fact
    assert "_get_fact" in f.get_fact.__code__.co_names  # get_fact calls the module's _get_fact, so patching works
    assert _params(f._make_command) == ["command_attribute", "host_args"]
    assert _params(f._handle_fact_kwargs) == ["state", "host", "cls", "args", "kwargs"]
    assert set(probe.IDENTITY_ARGS) <= set(f.CONNECTOR_ARGUMENT_KEYS)
    assert issubclass(Command, FactBase)
    for name in ("command", "requires_command", "shell_executable", "check_preconditions", "process", "default"):
        assert hasattr(Command(), name), name
    for name in probe.CHANGING:
        assert _params(inspect.unwrap(getattr(Host, name))) == ["self", "args", "kwargs"], name
    assert "current_op_global_arguments" in Host.__annotations__
    assert set(probe.CONNECTOR_IDENTITY) <= set(SSHConnector.data_meta)
    order = speedups._SHIPPED_ORDER  # rigforge/speedups.py operation_order does what it does: read a new one again
    assert order.__module__ == "pyinfra.api.util" and _params(order) == ["state"]
    assert hashlib.sha256(inspect.getsource(order).encode()).hexdigest()[:16] == "f4807f61585570e0"
    assert "get_operation_order_from_stack" in vars(sys.modules["pyinfra.api.operation"])  # called by that name
    assert "signature(func).bind(" in inspect.getsource(sys.modules["pyinfra.api.operation"])  # the module's name
    assert _params(speedups._ORIGINAL) == []
    pop = speedups._SHIPPED_POP  # rigforge/speedups.py does what it does: a new pyinfra's must be read again
    assert _params(pop) == ["state", "host", "kwargs"] and pop.__module__ == "pyinfra.api.arguments"
    assert hashlib.sha256(inspect.getsource(pop).encode()).hexdigest()[:16] == "a12a311539ff5068"
    assert all("pop_global_arguments" in vars(sys.modules[name]) for name in speedups._CALLERS)
    assert isinstance(Inventory((["h"], {})).get_host("h").data.datas, tuple)  # HostData's sources, in its order
    assert "all_global_arguments" in arguments.pop_global_arguments.__code__.co_names  # a global lookup: patchable


def test_every_host_method_that_can_change_a_rig_is_covered():
    """pyinfra 3.10's Host: a new method (pyinfra upgraded) fails here until it is sorted into one of these."""
    read_only = {"get_fact", "get_file", "connect", "disconnect", "check_can_rsync", "get_temp_filename"}
    read_only |= {"init", "loop", "log", "log_styled", "style_print_prefix", "noop", "when", "arguments", "deploy"}
    read_only |= {"get_deploy_data", "get_temp_dir_config"}
    methods = {n for n, v in vars(Host).items() if inspect.isfunction(v) and not n.startswith("_")}
    assert methods == read_only | set(probe.CHANGING)


@pytest.mark.parametrize(
    "ours, killed, older",
    [(False, False, False), (True, False, False), (False, True, False), (False, False, True)],
    ids=[
        "another run",
        "this run, its answer not read yet",
        "another run, after a killed run's line",
        "another run of an older rigforge (its line has no pid)",
    ],
)
def test_a_busy_lock_names_its_holder_caught_before_it_wrote_its_line(tmp_path, monkeypatch, ours, killed, older):
    """Another holder has the rig's lock but has not written its owner line yet (a busy rig: the two are separate
    steps): the answer waits for the line and names that run, rather than 'another run', nor the run a line left
    by a killed run names. When the holder is this very run under another inventory name, the answer says so,
    even before that name's own answer is read."""
    import socket
    from types import SimpleNamespace

    from roles import rig_lock

    monkeypatch.setattr(rig_lock, "_HELD", {})
    monkeypatch.setattr(rig_lock, "_SENT", {})
    lock = tmp_path / "rig.lock"
    run = f"{socket.gethostname()}, pid {os.getpid()}" if ours else "ctl, pid 1"
    owner = f"{run} (as rig9), since 2026-12-05T00:00:00+00:00"
    if killed:  # its holder on the rig is gone (the controller was killed, the link dropped): its pid with it
        gone = subprocess.Popen(["true"])
        gone.wait()
        Path(f"{lock}.owner").write_text(f"{gone.pid} ctl-killed, pid 7 (as rig1), since 2026-12-04T00:00:00+00:00\n")
    pid = "" if older else '"$$ "'  # the owner line of a rigforge before 588c708 did not start with a pid
    late = f"sleep 0.5; echo {pid}{shlex.quote(owner)} > {lock}.owner; sleep 30"  # the holder's own line
    other = subprocess.Popen(["flock", str(lock), "sh", "-c", late])
    try:
        while subprocess.run(["flock", "-n", str(lock), "true"]).returncode == 0:  # until the other run holds it
            time.sleep(0.01)
        transport = SimpleNamespace(open_session=_Channel)
        host = SimpleNamespace(
            name="rig1", connector=SimpleNamespace(client=SimpleNamespace(get_transport=lambda: transport))
        )
        rig_lock.send(host, str(lock), False)
        problem, _ = rig_lock.take(host)
    finally:
        other.kill()
        other.wait()
    if ours:
        assert problem == (
            f"rig1 and rig9 are one machine (this run holds its lock {lock} as rig9): remove one of the two names "
            "from the inventory"
        )
    else:
        assert problem == f"rig1 is being provisioned by {owner}; wait for that run to end, then run again"


@pytest.mark.parametrize("meanwhile", [False, True], ids=["rig free", "another run took it meanwhile"])
def test_after_a_reboot_the_run_takes_the_rigs_lock_again(tmp_path, monkeypatch, meanwhile):
    """The driver role's reboot ends this run's holder with its connection (here: its channel closed). The run
    takes the lock again on the new connection, so no other run starts on the rig while this one goes on; one
    that took it in between fails the host, named."""
    from types import SimpleNamespace

    from roles import rig_lock

    monkeypatch.setattr(rig_lock, "_HELD", {})
    monkeypatch.setattr(rig_lock, "_SENT", {})
    lock = str(tmp_path / "rig.lock")
    logged = []
    transport = SimpleNamespace(open_session=_Channel)
    host = SimpleNamespace(
        name="rig1",
        data={"_sudo": False},
        connector=SimpleNamespace(client=SimpleNamespace(get_transport=lambda: transport)),
        log_styled=lambda message, **kwargs: logged.append(message),
    )
    rig_lock.send(host, lock, False)
    assert rig_lock.take(host) == (None, None)
    rig_lock._HELD["rig1"].close()  # the reboot: the holder is gone, the lock free
    other = None
    if meanwhile:
        line = f'echo "$$ ctl2, pid 9 (as rig1)" > {lock}.owner; sleep 30'  # its holder's line
        other = subprocess.Popen(["flock", lock, "sh", "-c", line])
        while not Path(f"{lock}.owner").exists():
            time.sleep(0.01)
    try:
        assert rig_lock.retake(None, host, lock) is not meanwhile
        busy = subprocess.run(["flock", "-n", lock, "true"]).returncode != 0
        assert busy  # held: by this run again, or by the other one
        if meanwhile:
            assert logged == [
                "after the reboot: rig1 is being provisioned by ctl2, pid 9 (as rig1); wait for that "
                "run to end, then run again"
            ]
        else:
            assert "rig1" in rig_lock._HELD and logged == []
    finally:
        for channel in rig_lock._HELD.values():
            channel.close()
        if other:
            other.kill()
            other.wait()
