"""What `rigforge status` and `verify` say, made true (issue 47), where no testbed rig is needed: an unreachable
rig is one line, the gateway host is not counted as a rig, a recipe slug is not a variant mismatch, each skip gives
its own reason, a rig's own record of its rest is read, and an un-rested unit is started for the reason that holds.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_roles_host_ops import converge, executed, make_plan, rig, uploads
from test_serving_ops import SHOW, UNIT, converged_responses

from rigforge.cli import status, verify
from rigforge.model import fleet
from rigforge.observe import drift
from rigforge.observe.drift import SKIP, SKIPPED, Check
from rigforge.observe.hosts import RigContext, rest_record
from roles import serving

REPO = Path(__file__).resolve().parents[1]


def rigforge(cmd: str, inventory: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rigforge.cli", cmd, str(inventory), *extra],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def silent_port():
    """A port that accepts and hangs up without a word: what a rig powered off behind a forwarded port looks like
    (paramiko: "Error reading SSH protocol banner", which it logs with a traceback)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.2)
    done = threading.Event()

    def serve():
        while not done.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    done.set()
    thread.join(timeout=5)
    server.close()


def gone_inventory(path: Path, silent: int) -> Path:
    closed = closed_port()
    path.write_text(
        f"rigs = [('rig-silent', {{'ssh_hostname': '127.0.0.1', 'ssh_port': {silent}}}),\n"
        f"        ('rig-closed', {{'ssh_hostname': '127.0.0.1', 'ssh_port': {closed}}})]\n"
        f"gateway = [('gw', {{'ssh_hostname': '127.0.0.1', 'ssh_port': {closed}}})]\n"
    )
    return path


@pytest.mark.parametrize("cmd", ["status", "verify"])
def test_an_unreachable_rig_is_one_line_without_a_traceback(cmd, tmp_path, silent_port):
    r = rigforge(cmd, gone_inventory(tmp_path / "gone.py", silent_port))
    assert r.returncode == (2 if cmd == "verify" else 1), r.stdout + r.stderr
    assert "Traceback" not in r.stderr and "paramiko" not in r.stderr and "Exception" not in r.stderr, r.stderr
    assert r.stderr == ""
    lines = r.stdout.splitlines()
    for host in ("rig-silent", "rig-closed", "gw"):
        said = [line for line in lines if line.startswith(f"{host} ")]
        assert len(said) == 1 and "ERROR" in said[0] and "cannot connect" in said[0], lines
    assert "SSH protocol banner" in next(line for line in lines if line.startswith("rig-silent "))
    assert "Unable to connect to port" in next(line for line in lines if line.startswith("rig-closed "))
    if cmd == "verify":
        assert lines[-1] == (
            "2 rig(s) and 1 gateway: no check failed on the rigs checked; could not check rig-silent, rig-closed, gw"
        )


def test_the_summary_counts_rigs_apart_from_the_fleet_hosts():
    def of(**roles) -> fleet.Fleet:
        return fleet.Fleet(roles={h: frozenset(r) for h, r in roles.items()}, plans={}, problems={})

    results = dict.fromkeys(["rig1", "rig2", "rig3", "gw"])
    three = of(rig1={"rig"}, rig2={"rig"}, rig3={"rig"}, gw={"gateway"})
    assert verify.hosts_counted(results, three) == "3 rig(s) and 1 gateway"
    both = of(rig1={"rig", "gateway"}, rig2={"rig"}, rig3={"rig"}, gw={"gateway", "monitor"})
    assert verify.hosts_counted(results, both) == "3 rig(s), 2 gateways and 1 monitor"
    assert verify.hosts_counted({"rig1": None}, of(rig1={"rig"})) == "1 rig(s)"


def test_the_summary_gives_each_skips_own_reason():
    resting = "resting stopped (serving_rest: stopped)"
    checked = {
        "rig1": [Check("unit active", SKIP, SKIPPED), Check("tool call returned", SKIP, SKIPPED)],
        "rig2": [Check("unit active", "pass", "active"), Check("tool call returned", SKIP, resting)],
        "rig3": [Check("unit active", SKIP, SKIPPED)],
    }
    assert verify.skip_reasons(checked) == {
        "services not managed on this host": ["rig1", "rig3"],
        resting: ["rig2"],
    }


def row(variant: str, inventory: str, recipe: str | None) -> dict:
    """A read rig's status row, as status_row makes it, with only what the VARIANT cell needs to vary."""
    return {
        "host": "rig1",
        "error": None,
        "variant": variant,
        "variant_in_inventory": inventory,
        "recipe": recipe,
        "pin_drift": [],
        "manifest": True,
        "lock_error": None,
        "gpus": [],
        "service": {"unit": None},
        "services_managed": True,
        "api": {"reachable": True},
        "cuda": {"driver": "13.0", "image": "13.0"},
    }


def test_a_recipe_slug_rig_is_not_flagged_as_another_variant():
    assert status._cells(row("vllm-dual", "vllm/dual", "vllm/dual"))[1] == "vllm-dual"
    assert status._cells(row("dual-turbo", "dual-turbo", None))[1] == "dual-turbo"
    # a real mismatch keeps its marker: the rig runs what rig.json records, the inventory asks for another
    assert status._cells(row("vllm-dual", "dual-turbo", "vllm/dual"))[1] == "vllm-dual (inventory: dual-turbo)"
    assert status._cells(row("vllm-dual", "vllm/quad", "vllm/dual"))[1] == "vllm-dual (inventory: vllm/quad)"
    slug = SimpleNamespace(variant=None, manifest={"variant": "vllm-dual", "recipe": "vllm/dual"})
    assert status.recipe_of(slug) == "vllm/dual"
    seed = SimpleNamespace(variant=SimpleNamespace(manifest_extra={}), manifest={"variant": "dual-turbo"})
    assert status.recipe_of(seed) is None


# ---------------------------------------------------------------- a resting rig's own record


def test_the_rest_a_rig_records_is_read_when_host_data_sets_none():
    recorded = RigContext(name="r", data={"serving_rest": None}, manifest={"serving_rest": "stopped"})
    rest_record(recorded, "/etc/rigforge/rig.json")
    assert recorded.data["serving_rest"] == "stopped"
    assert recorded.rest_from == "/etc/rigforge/rig.json records serving_rest: stopped, from the last deploy"
    declared = RigContext(name="r", data={"serving_rest": "drained"}, manifest={"serving_rest": "stopped"})
    rest_record(declared, "/etc/rigforge/rig.json")  # host data's is what is declared
    assert (declared.data["serving_rest"], declared.rest_from) == ("drained", "host data serving_rest")
    for manifest in (None, {}, {"serving_rest": "bogus"}):
        none = RigContext(name="r", data={"serving_rest": None}, manifest=manifest)
        rest_record(none, "/etc/rigforge/rig.json")
        assert none.data["serving_rest"] is None


def managed(responses: dict, **plan_data):
    data = rig(rigforge_manage_services=True, _sudo=True, ssh_user="me")
    data["fake_responses"] = {**responses, **data["fake_responses"]}
    state = converge({"r": data}, serving.apply, make_plan("dual-turbo", **plan_data))
    assert not state.failed_hosts
    return state


def test_the_deploy_records_the_rest_it_applied_in_rig_json():
    def recorded(state) -> dict:
        return json.loads(next(text for path, text in uploads(state, "r").items() if "rig.json" in path))

    assert recorded(managed(converged_responses(), serving_rest="stopped"))["serving_rest"] == "stopped"
    assert "serving_rest" not in recorded(managed(converged_responses()))


@pytest.mark.parametrize(
    "active, sub, reason, verb",
    [
        ("inactive", "dead", "it is stopped", "start"),  # serving_rest: stopped lifted: disabled and stopped
        ("active", "running", "it was just enabled as the only vLLM instance", "restart"),  # disabled by hand
    ],
)
def test_an_enabled_unit_is_started_for_the_reason_that_holds(caplog, active, sub, reason, verb):
    responses = converged_responses()
    responses["multi-user.target.wants"] = ""  # no instance enabled: the rest disabled it
    responses[SHOW] = [f"ActiveState={active}", f"SubState={sub}", "Result=success", "NRestarts=0"]
    with caplog.at_level(logging.INFO):
        cmds = executed(managed(responses), "r")
    assert f"systemctl enable {UNIT}" in cmds
    assert any(re.match(rf"systemctl {verb} {re.escape(UNIT)}( |$)", c) for c in cmds), cmds
    assert f"{UNIT}: {reason}: {verb}ing it" in caplog.text
    assert "its compose file" not in caplog.text  # what it said before: "... unit or instance changed"


def test_a_changed_compose_file_is_the_reason_it_names(caplog):
    compose = "/opt/rigforge/serve/dual-turbo/docker-compose.yml"
    responses = {re.compile(rf"sha256sum {compose}\b"): f"{'0' * 64}  {compose}", **converged_responses()}
    with caplog.at_level(logging.INFO):
        managed(responses)
    assert f"{UNIT}: its compose file, .env or unit changed: restarting it" in caplog.text


def test_a_unit_that_never_ran_is_started_not_restarted(caplog):
    """A fresh rig: its compose file was just written and the unit never ran; the run says it starts it."""
    compose = "/opt/rigforge/serve/dual-turbo/docker-compose.yml"
    responses = {re.compile(rf"sha256sum {compose}\b"): f"{'0' * 64}  {compose}", **converged_responses()}
    responses[SHOW] = ["ActiveState=inactive", "SubState=dead", "Result=success", "NRestarts=0"]
    with caplog.at_level(logging.INFO):
        cmds = executed(managed(responses), "r")
    assert f"{UNIT}: its compose file, .env or unit changed: starting it" in caplog.text
    assert any(re.match(rf"systemctl start {re.escape(UNIT)}( |$)", c) for c in cmds), cmds


def test_a_gateway_knows_the_rest_a_rig_records():
    """rig1 rests (rig.json records serving_rest: stopped, host data none): out of the gateway on purpose, so the
    gateway's "rigs up" passes; the rig's own check says it is DOWN but not drained there (the deploy drains it)."""
    down = {"admin": "ready", "up": False, "port": 8000, "since_s": 40, "last_check": "L4CON"}
    up = {**down, "up": True}
    view = {
        "rigs": {"rig1": "DOWN (40 s; last check: L4CON)", "rig2": "UP"},
        "servers": {"rig1": {"b": down}, "rig2": {"b": up}},
    }
    place = drift.GatewayPlace("b", 8000)
    results = {
        "rig1": ([Check("unit active", "pass", "active")], {"rig": True, "rest": "stopped", "place": place}),
        "gw": ([verify.rigs_up(view, set())], {"rig": False, "rest": None, "gateway": view, "resting": set()}),
    }
    assert results["gw"][0][0].status == "fail"  # what the gateway host alone knows: host data sets no rest
    checked = verify.with_fleet_checks(results, ())
    up = checked["gw"][0][0]
    assert (up.name, up.status) == ("gateway rigs up", "pass"), up
    served = [c for c in checked["rig1"][0] if c.name == "serving at the gateways"]
    assert served[0].status == "fail" and "declared drained (serving_rest: stopped)" in served[0].detail, served
    results["rig1"][1]["place"] = None
    view["servers"]["rig1"]["b"] = {**down, "admin": "drain"}
    view["rigs"]["rig1"] = "DRAIN"
    served = [c for c in verify.with_fleet_checks(results, ())["rig1"][0] if c.name == "serving at the gateways"]
    assert served[0].status == "skip", served  # no variant: no place to compare with
    results["rig1"][1]["place"] = place
    served = [c for c in verify.with_fleet_checks(results, ())["rig1"][0] if c.name == "serving at the gateways"]
    assert served[0].status == "pass" and "resting on purpose (serving_rest: stopped)" in served[0].detail, served
