"""Tier 2: the serving role with services managed (a real rig), against faked facts on pyinfra's @fake connector.

The testbed has no systemd or Docker engine, so this is where the managed path is checked: the image is
pulled before the service starts, units are reloaded only when one changed, the health gate runs after a
(re)start, a switch disables the previous instance, and a converged rig gets no pull, restart or gate.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from types import SimpleNamespace

from pyinfra.api import FileUploadCommand
from pyinfra.context import ctx_host, ctx_state
from support import render_variant
from test_roles_host_ops import converge, executed, host_of, make_plan, make_state, rig

from rigforge.model.catalog import load_catalog
from rigforge.model.schema import Settings
from roles import serving
from roles.operations.serving import manifest

VARIANT = load_catalog().variants["dual-turbo"]
UNIT = "rigforge-vllm@dual-turbo.service"


def run(responses: dict | None = None, plan=None):
    data = rig(rigforge_manage_services=True, _sudo=True, ssh_user="me")
    data["fake_responses"] = {**(responses or {}), **data["fake_responses"]}  # first match wins: ours first
    state = converge({"r": data}, serving.apply, plan or make_plan("dual-turbo"))
    assert not state.failed_hosts
    return executed(state, "r")


GATE = r"rigforge health gate: http"  # the gate script's last line
SHOW = re.compile(r"^systemctl show -p ActiveState")
API = re.compile(r"curl -s -o /dev/null -w")


def first(cmds, pattern) -> int:
    return next(i for i, c in enumerate(cmds) if re.search(pattern, c))


def test_fresh_rig_pulls_before_starting_then_gates_on_health():
    cmds = run()
    pull = first(cmds, r"^docker pull vllm/vllm-openai(:nightly-|@sha256:)")
    reload_ = first(cmds, r"^systemctl daemon-reload$")
    enable = first(cmds, rf"^systemctl enable {re.escape(UNIT)}$")
    start = first(cmds, rf"^systemctl (start|restart) {re.escape(UNIT)}( |$)")
    gate = first(cmds, GATE)
    compose_in_place = first(cmds, r"^mv -f /opt/rigforge/serve/dual-turbo/.staging/docker-compose.yml ")
    assert compose_in_place < pull < start and reload_ < start and enable < start < gate
    assert first(cmds, r"docker compose config -q") < compose_in_place


def stat_line(path: str, mode: str) -> str:
    return f"user=root group=root mode={mode} atime=0 mtime=0 ctime=0 size=1 '{path}'"


def converged_responses() -> dict:
    files = render_variant(VARIANT, Settings())
    serve = "/opt/rigforge/serve/dual-turbo"
    installed = {
        f"{serve}/docker-compose.yml": (files["docker-compose.yml"], "-rw-r--r--"),
        f"{serve}/.env": (files[".env"], "-rw-------"),
        "/etc/systemd/system/rigforge-vllm@.service": (files["rigforge-vllm@.service"], "-rw-r--r--"),
    }
    responses = {}
    for path, (text, mode) in installed.items():
        digest = hashlib.sha256(text.encode()).hexdigest()
        responses[re.compile(rf"sha256sum {re.escape(path)}\b")] = f"{digest}  {path}"
        responses[re.compile(rf"stat -c .* {re.escape(path)}( |$)")] = stat_line(path, mode)
    responses["docker image inspect"] = "yes"
    responses["multi-user.target.wants"] = UNIT
    responses[SHOW] = ["ActiveState=active", "SubState=running", "Result=success", "NRestarts=0"]
    responses[API] = "200"
    return responses


def test_converged_rig_is_not_pulled_restarted_reloaded_or_gated():
    cmds = run(converged_responses())
    assert not [c for c in cmds if re.search(r"^(docker pull|systemctl (start|restart|daemon-reload|enable))", c)]
    assert not [c for c in cmds if re.search(GATE, c)]
    assert not [c for c in cmds if re.search(r"^(mkdir|mv|rm|cp|touch|chmod)\b.*\.staging", c)]  # facts only


def test_switch_disables_the_previous_instance_and_gates_with_rollback_to_it():
    responses = converged_responses()
    responses["multi-user.target.wants"] = "rigforge-vllm@dual.service"
    cmds = run(responses)
    disable = first(cmds, r"^systemctl disable --now rigforge-vllm@dual.service$")
    enable = first(cmds, rf"^systemctl enable {re.escape(UNIT)}$")
    start = first(cmds, rf"^systemctl (start|restart) {re.escape(UNIT)}( |$)")
    gate = cmds[first(cmds, GATE)]
    assert disable < enable < start
    assert "systemctl enable --now rigforge-vllm@dual.service" in gate  # the rollback target


def found(active: str, sub: str, api: str = "000", more: dict | None = None, plan=None) -> list[str]:
    """The commands a converged rig gets when systemd says `active`/`sub` of its unit and the API answers `api`."""
    responses = converged_responses()
    responses[SHOW] = [f"ActiveState={active}", f"SubState={sub}", "Result=exit-code", "NRestarts=3"]
    responses[API] = api
    return run({**(more or {}), **responses}, plan)


def test_a_stopped_or_failed_unit_is_started_once_and_gated_without_a_rollback():
    for active, sub in (("inactive", "dead"), ("failed", "failed")):
        cmds = found(active, sub)
        reset = first(cmds, rf"^systemctl reset-failed {re.escape(UNIT)}")
        start = first(cmds, rf"^systemctl start {re.escape(UNIT)}( |$)")
        gate = first(cmds, GATE)
        assert reset < start < gate, (active, cmds)
        # nothing of it changed in this run: the gate leaves it as it is, never swaps in an older compose file
        assert "docker-compose.yml.prev" not in cmds[gate] and "left as it is" in cmds[gate]
        assert not [c for c in cmds if re.search(r"^systemctl restart", c)]


def test_a_crash_looping_unit_is_restarted_and_a_starting_one_only_waited_for():
    cmds = found("activating", "auto-restart")
    assert first(cmds, rf"^systemctl restart {re.escape(UNIT)}( |$)") < first(cmds, GATE)
    cmds = found("activating", "start")  # a start job in progress: the gate waits, nothing restarts it
    assert not [c for c in cmds if re.search(r"^systemctl (start|restart)", c)]
    assert first(cmds, GATE) >= 0


def test_a_running_unit_whose_api_does_not_answer_is_waited_for_not_restarted():
    cmds = found("active", "running", api="000")
    assert not [c for c in cmds if re.search(r"^systemctl (start|restart)", c)]
    assert "left as it is" in cmds[first(cmds, GATE)]


def test_a_container_on_another_image_is_restarted():
    plan = make_plan("dual-turbo")
    pinned = dataclasses.replace(plan.settings, image=f"{plan.image}@sha256:{'1' * 64}")
    plan = dataclasses.replace(plan, settings=pinned)  # the lock pins a digest
    ps = re.compile(r"docker compose ps -q")
    cmds = found("active", "running", "200", {ps: f'["vllm/vllm-openai@sha256:{"0" * 64}"]'}, plan)
    assert first(cmds, rf"^systemctl restart {re.escape(UNIT)}( |$)") < first(cmds, GATE)
    cmds = found("active", "running", "200", {ps: f'["vllm/vllm-openai@sha256:{"1" * 64}"]'}, plan)
    assert not [c for c in cmds if re.search(rf"^systemctl (start|restart)|{GATE}", c)]  # the locked digest runs


def test_a_rig_resting_stopped_is_stopped_and_disabled_and_not_gated():
    data = rig(rigforge_manage_services=True, _sudo=True, ssh_user="me", serving_rest="stopped")
    data["fake_responses"] = {**converged_responses(), **data["fake_responses"]}
    plan = make_plan("dual-turbo", serving_rest="stopped")
    state = converge({"r": data}, serving.apply, plan)
    cmds = executed(state, "r")
    assert f"systemctl disable --now {UNIT}" in cmds and f"systemctl stop {UNIT}" in cmds
    assert not [c for c in cmds if re.search(GATE, c) or re.search(r"^systemctl (start|restart|enable) ", c)]


def test_the_manifest_reads_the_interconnect_only_when_it_is_written():
    """rig.json records the GPUs' interconnect (`nvidia-smi topo -m`, `topo -p2p r`): read when the manifest is
    written, not on a re-run that finds it up to date."""
    topo = [
        "--- topo -m",
        "\tGPU0\tGPU1",
        "GPU0\t X \tPHB",
        "GPU1\tPHB\t X ",
        "--- topo -p2p r",
        "\tGPU0\tGPU1",
        "GPU0\tX\tCNS",
        "GPU1\tCNS\tX",
    ]
    interconnect = {"links": {"0-1": "PHB"}, "p2p_read": {"0-1": "CNS"}}
    content = {"variant": "dual-turbo", "port": 8011}

    def run(current: dict | None):
        data = rig(extra={"topo -m": topo, "cat /etc/rigforge/rig.json": json.dumps(current) if current else ""})
        state = make_state({"r": data})
        host = host_of(state, "r")
        with ctx_state.use(state), ctx_host.use(host):
            plan = SimpleNamespace(layout=SimpleNamespace(rig_json="/etc/rigforge/rig.json"), manifest=content)
            cmds = list(manifest._inner(plan, "2026-12-04T00:00:00+00:00"))
        uploaded = [c.src.getvalue().decode() for c in cmds if isinstance(c, FileUploadCommand)]
        return uploaded, any("topo" in c for c in host.connector.executed_commands)

    uploaded, read = run(None)  # a fresh rig: written, with the interconnect read now
    written = json.loads(uploaded[0])
    assert read and written["interconnect"] == interconnect and written["variant"] == "dual-turbo", written

    assert run(written) == ([], False)  # up to date: nothing written, nvidia-smi topo not run
    uploaded, read = run({**written, "variant": "dual"})  # another variant recorded: rewritten, the interconnect read
    assert read and json.loads(uploaded[0]) == written
    assert written["gpus"][1]["pci_bus_id"] == "00000000:02:00.0"
    moved = [{**gpu, "pci_bus_id": f"00000000:{gpu['index'] + 3:02x}:00.0"} for gpu in written["gpus"]]
    uploaded, read = run({**written, "gpus": moved})  # the cards were in other slots: rewritten, the interconnect read
    assert read and json.loads(uploaded[0]) == written
    stale = {**written, "interconnect": {"links": {}, "p2p_read": {}}}
    assert run(stale) == ([], False)  # the same cards in the same slots: kept as recorded, not read again
