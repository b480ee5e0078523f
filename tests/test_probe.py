"""Tier 1: the batched probe (rigforge/facts/probe.py) on pyinfra's @local connector, no root, no rigs.

- After a recording run, the next run reads every fact in ONE command and serves them all: the batched path is
  taken (it fails when the probe is not installed);
- a change to the host (a command, an upload, an rsync) ends the answers from the probe;
- `read()` batches any list of facts;
- the deploy entry installs the probe and importing roles.site changes nothing;
- the private pyinfra names and signatures the probe and rigforge/speedups.py rely on are still there.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import json
import subprocess
import sys

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
from rigforge.facts import probe


@pytest.fixture
def shipped(monkeypatch, tmp_path):
    """pyinfra as shipped, the probe's cache in tmp_path; whatever was patched before is restored after."""
    monkeypatch.setenv("RIGFORGE_PROBE_CACHE", str(tmp_path / "probes"))
    monkeypatch.setattr(pyinfra_facts, "_get_fact", probe._original_get_fact or pyinfra_facts._get_fact)
    for name in probe.CHANGING:
        monkeypatch.setattr(Host, name, inspect.unwrap(getattr(Host, name)))
    for module, name in ((util, "stack"), (util, "getframeinfo")):
        monkeypatch.setattr(module, name, getattr(inspect, name))
    monkeypatch.setattr(arguments, "all_global_arguments", speedups._ORIGINAL)
    monkeypatch.setattr(pyinfra_facts, "all_global_arguments", speedups._ORIGINAL)
    monkeypatch.setattr(probe, "_original_get_fact", None)
    monkeypatch.setattr(probe, "_SNAPSHOTS", {})
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
    monkeypatch.setattr(site, "hold_the_rig", lambda: True)  # no rig to lock here
    monkeypatch.setattr(site, "front_the_fleet", lambda *args: True)  # no inventory groups on this bare host
    monkeypatch.setattr(site, "serve_the_registry", lambda *args: True)
    monkeypatch.setattr(site, "is_rig", lambda h: True)
    monkeypatch.setattr(site, "prepare", lambda *args, **kwargs: None)  # a refused host: provision returns
    site.provision._inner()
    assert pyinfra_facts._get_fact is probe._get_fact
    assert all(getattr(Host, name).__wrapped__ for name in probe.CHANGING)
    assert util.stack is not inspect.stack and hasattr(arguments.all_global_arguments, "cache_info")
    names = "f._get_fact, h.Host.run_shell_command, h.Host.put_file, h.Host.rsync, u.stack, u.getframeinfo"
    names += ", a.all_global_arguments"
    code = (
        "import pyinfra.api.facts as f, pyinfra.api.host as h, pyinfra.api.util as u, pyinfra.api.arguments as a\n"
        f"before = ({names})\nimport roles.site\nraise SystemExit(0 if before == ({names}) else 1)\n"
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
    order = util.get_operation_order_from_stack
    assert {"stack", "getframeinfo"} <= set(order.__code__.co_names) and order.__globals__ is vars(util)
    assert _params(speedups._ORIGINAL) == []
    assert "all_global_arguments" in arguments.pop_global_arguments.__code__.co_names  # a global lookup: patchable


def test_every_host_method_that_can_change_a_rig_is_covered():
    """pyinfra 3.10's Host: a new method (pyinfra upgraded) fails here until it is sorted into one of these."""
    read_only = {"get_fact", "get_file", "connect", "disconnect", "check_can_rsync", "get_temp_filename"}
    read_only |= {"init", "loop", "log", "log_styled", "style_print_prefix", "noop", "when", "arguments", "deploy"}
    read_only |= {"get_deploy_data", "get_temp_dir_config"}
    methods = {n for n, v in vars(Host).items() if inspect.isfunction(v) and not n.startswith("_")}
    assert methods == read_only | set(probe.CHANGING)
