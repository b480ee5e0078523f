"""Tier 2: the serving role with services managed (a real rig), against faked facts on pyinfra's @fake connector.

The testbed has no systemd or Docker engine, so this is where the managed path is checked: the image is
pulled before the service starts, units are reloaded only when one changed, the health gate runs after a
(re)start, a switch disables the previous instance, and a converged rig gets no pull, restart or gate.
"""

from __future__ import annotations

import hashlib
import re

from test_roles_host_ops import converge, executed, make_plan, rig

from rigforge.catalog import load_catalog
from rigforge.render import render_variant
from rigforge.schema import Settings
from roles import serving

VARIANT = load_catalog().variant("dual-turbo")
UNIT = "rigforge-vllm@dual-turbo.service"


def run(responses: dict | None = None):
    data = rig(rigforge_manage_services=True, _sudo=True, ssh_user="me")
    data["fake_responses"] = {**(responses or {}), **data["fake_responses"]}  # first match wins: ours first
    state = converge({"r": data}, serving.apply, make_plan("dual-turbo"))
    assert not state.failed_hosts
    return executed(state, "r")


def first(cmds, pattern) -> int:
    return next(i for i, c in enumerate(cmds) if re.search(pattern, c))


def test_fresh_rig_pulls_before_starting_then_gates_on_health():
    cmds = run()
    pull = first(cmds, r"^docker pull vllm/vllm-openai(:nightly-|@sha256:)")
    reload_ = first(cmds, r"^systemctl daemon-reload$")
    enable = first(cmds, rf"^systemctl enable {re.escape(UNIT)}$")
    start = first(cmds, rf"^systemctl (start|restart) {re.escape(UNIT)}$")
    gate = first(cmds, r"/v1/models")
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
    return responses


def test_converged_rig_is_not_pulled_restarted_reloaded_or_gated():
    cmds = run(converged_responses())
    assert not [c for c in cmds if re.search(r"^(docker pull|systemctl (start|restart|daemon-reload|enable))", c)]
    assert not [c for c in cmds if "/v1/models" in c]
    assert not [c for c in cmds if re.search(r"^(mkdir|mv|rm|cp|touch|chmod)\b.*\.staging", c)]  # facts only


def test_switch_disables_the_previous_instance_and_gates_with_rollback_to_it():
    responses = converged_responses()
    responses["multi-user.target.wants"] = "rigforge-vllm@dual.service"
    cmds = run(responses)
    disable = first(cmds, r"^systemctl disable --now rigforge-vllm@dual.service$")
    enable = first(cmds, rf"^systemctl enable {re.escape(UNIT)}$")
    start = first(cmds, rf"^systemctl (start|restart) {re.escape(UNIT)}$")
    gate = cmds[first(cmds, r"/v1/models")]
    assert disable < enable < start
    assert "systemctl enable --now rigforge-vllm@dual.service" in gate  # the rollback target
