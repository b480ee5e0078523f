"""Tier 2: drift reads the rig only through the facts its batched probe asks for, and compares what rigforge
renders with the plan's own text (no host: the rig's answers are given)."""

from __future__ import annotations

import dataclasses
import hashlib

from pyinfra.facts.files import File, Sha256File

from rigforge.layout import HostLayout
from rigforge.model import fleet
from rigforge.observe import drift, hosts
from rigforge.observe.facts import cycles, probe
from rigforge.observe.facts.files import JsonFile
from rigforge.observe.facts.serving import ComposeImages, ServiceState
from rigforge.observe.facts.system import OsRelease, SystemdUnitEnabled

ANSWERS = {  # what a fresh rig answers, per fact class name
    "NvidiaGpus": [],
    "OsRelease": {"id": "debian", "version_id": "13", "codename": "trixie"},
    "GitCheckout": None,
    "WeightsState": {"stamp": None, "files": {}},
    "Sha256File": None,
    "File": None,
    "DebPackages": {},
    "AptHeldPackages": [],
    "ProvidedFiles": {},
    "JsonFile": None,
    "SystemdUnitEnabled": False,
    "ServiceState": {"active": "unknown", "sub": "", "result": "", "restarts": 0, "enabled": ""},
    "ApiAnswers": 0,
    "ComposeImages": [],
    "NvidiaModuleVersion": None,
    "NvidiaRunningDriver": None,
    "DebInstalledVersion": None,
    "BootCaps": {},
    "OrderingCycles": cycles.parse([]),
}


class Recording:
    """An Observed that answers from ANSWERS (or `given`) and records every fact read."""

    def __init__(self, given=None):
        self.read, self.given = [], given or {}

    def get_fact(self, cls, **kwargs):
        key = probe.fact_key(cls, kwargs)
        self.read.append(key)
        return self.given.get(key, ANSWERS[cls.__name__])


def context(manifest=None, **data):
    plan, problems = fleet.plan_for("rig1", {"rigforge_variant": "dual-turbo", **data}, deployable=False)
    assert plan, problems
    return hosts.RigContext(
        name="rig1",
        data=fleet.host_data(data),
        plan=plan,
        layout=plan.layout,
        variant_name="dual-turbo",
        manifest=manifest,
    )


def test_every_fact_the_checks_read_is_in_the_one_probe():
    for manifest in (None, {"variant": "dual-turbo", "unit": "rigforge-vllm@dual-turbo.service"}):
        ctx = context(manifest, rigforge_manage_services=True)
        obs = Recording()
        drift.checks(obs, ctx)
        drift.rig_drift(obs, ctx)
        asked = {
            probe.fact_key(cls, kwargs) for cls, kwargs in hosts.requests(ctx, {"id": "debian", "version_id": "13"})
        }
        assert obs.read and set(obs.read) <= asked, set(obs.read) - asked


def test_a_hand_edited_file_is_named_and_no_rendered_file_holds_the_token(monkeypatch):
    monkeypatch.setenv("RIGFORGE_HF_TOKEN", "hf_" + "t" * 34)
    ctx = context()
    plan = ctx.plan
    assert plan.token and not any(plan.token in text for text in plan.files.values())
    compose = f"{plan.layout.serve_dir}/docker-compose.yml"
    env = f"{plan.layout.serve_dir}/.env"
    as_planned = {}
    for path, (text, mode) in hosts.managed_files(plan).items():
        as_planned[probe.fact_key(Sha256File, {"path": path})] = hashlib.sha256(text.encode()).hexdigest()
        as_planned[probe.fact_key(File, {"path": path})] = {"mode": int(mode)}
    assert list(drift.files(Recording(as_planned), plan)) == []
    edited = {**as_planned, probe.fact_key(Sha256File, {"path": compose}): "0" * 64}
    assert list(drift.files(Recording(edited), plan)) == [
        f"{compose} differs from what rigforge renders (edited on the rig? the deploy rewrites it)"
    ]
    readable = {**as_planned, probe.fact_key(File, {"path": env}): {"mode": 644}}
    assert list(drift.files(Recording(readable), plan)) == [f"{env} has mode 644, rigforge's is 600"]
    missing = {k: v for k, v in as_planned.items() if env not in k}
    assert list(drift.files(Recording(missing), plan)) == [f"{env} is missing"]


def test_daemon_json_is_compared_on_the_key_rigforge_owns_only():
    ctx = context()
    daemon = probe.fact_key(JsonFile, {"path": HostLayout().daemon_json})
    mine = {"runtimes": {"nvidia": {"args": [], "path": "nvidia-container-runtime"}}}
    assert drift.runtime(Recording({daemon: {**mine, "log-level": "warn"}}), ctx).status == "pass"
    other = {"runtimes": {"nvidia": {"path": "/usr/local/bin/x"}}}
    assert drift.runtime(Recording({daemon: other}), ctx).status == "fail"
    assert drift.runtime(Recording({daemon: None}), ctx).status == "fail"
    assert probe.fact_key(OsRelease, {}) in {
        probe.fact_key(c, k) for c, k in hosts.requests(ctx, {"id": "debian", "version_id": "13"})
    }


def test_pins_compare_the_rig_with_the_plans_image_so_a_digest_pinned_lock_shows_no_drift():
    ctx = context()
    pinned = f"{ctx.plan.image.split('@')[0]}@sha256:{'a' * 64}"
    plan = dataclasses.replace(ctx.plan, settings=dataclasses.replace(ctx.plan.settings, image=pinned))
    ctx = dataclasses.replace(ctx, plan=plan, lock=plan.lock, manifest={**plan.manifest})
    assert drift.pin_drift(ctx)["drift"] == []
    assert drift.pins_check(ctx).status == "pass"
    moved = dataclasses.replace(ctx, manifest={**plan.manifest, "image": "vllm/vllm-openai:v0.31.0"})
    assert drift.pin_drift(moved)["drift"] == [f"image: rig vllm/vllm-openai:v0.31.0, lock {pinned}"]


def unit_answers(active, sub, enabled=True, images=(), api=200):
    unit = "rigforge-vllm@dual-turbo.service"
    return {
        probe.fact_key(SystemdUnitEnabled, {"unit": unit}): enabled,
        probe.fact_key(ServiceState, {"unit": unit}): {"active": active, "sub": sub, "result": "", "restarts": 0},
        probe.fact_key(ComposeImages, {"serve_dir": "/opt/rigforge/serve/dual-turbo"}): [list(images)],
    }


def by_name(checks):
    return {c.name: c for c in checks}


def test_what_runs_is_checked_and_a_rig_resting_on_purpose_is_not_drift():
    manifest = {"variant": "dual-turbo", "unit": "rigforge-vllm@dual-turbo.service"}
    ctx = context(manifest, rigforge_manage_services=True)
    stopped = by_name(drift.checks(Recording(unit_answers("inactive", "dead")), ctx))
    assert stopped["unit active"].status == "fail" and "inactive" in stopped["unit active"].detail
    resting = context(manifest, rigforge_manage_services=True, serving_rest="stopped")
    checks = by_name(drift.checks(Recording(unit_answers("inactive", "dead", enabled=False)), resting))
    assert checks["unit active"].status == "pass" and "on purpose" in checks["unit active"].detail
    assert checks["unit enabled"].status == "pass"
    checks = by_name(drift.checks(Recording(unit_answers("active", "running", enabled=True)), resting))
    assert checks["unit active"].status == "fail" and checks["unit enabled"].status == "fail"


def server(admin: str = "ready", up: bool = True, port: int = 8000) -> dict:
    """One server record as hosts.gateway_servers reads it."""
    return {"admin": admin, "up": up, "port": port, "since_s": 40, "last_check": "L4CON Connection refused"}


def test_a_rig_at_the_gateways_serves_unless_it_rests_there_on_purpose():
    """verdict.gateway_server, through drift.gateway_check: UP at its port in its model's backend, or drained."""
    backend = "qwen"
    servers = {
        "rig1": {backend: server(admin="drain"), "other": server(admin="maint")},
        "rig2": {backend: server()},
        "rig4": {backend: server(up=False)},
        "rig5": {backend: server(port=8111)},
        "rig6": {"other": server()},
    }
    views = {"gw": {"servers": servers, "rigs": {r: "said" for r in servers}}}
    place = drift.GatewayPlace(backend, 8000)
    assert drift.gateway_check("rig2", place, None, views).status == "pass"
    assert drift.gateway_check("rig1", place, None, views).status == "fail"
    assert drift.gateway_check("rig1", place, "drained", views).status == "pass"
    assert drift.gateway_check("rig2", place, "drained", views).status == "fail"
    down = drift.gateway_check("rig4", place, None, views)
    assert down.status == "fail" and "DOWN (40 s; last check: L4CON Connection refused) at gw" in down.detail, down
    assert drift.gateway_check("rig4", place, "drained", views).status == "fail"  # health down, yet still ready there
    moved = drift.gateway_check("rig5", place, None, views)
    assert moved.status == "fail" and "sent to port 8111, the rig serves on 8000" in moved.detail, moved
    assert "not in backend qwen" in drift.gateway_check("rig6", place, None, views).detail
    assert drift.gateway_check("rig2", None, None, views).status == "skip"  # no variant: nothing to compare with
    assert drift.gateway_check("rig3", place, None, views) is None  # behind no gateway: no check
