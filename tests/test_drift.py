"""Tier 2: drift reads the rig only through the facts its batched probe asks for, and compares what rigforge
renders with the plan's own text (no host: the rig's answers are given)."""

from __future__ import annotations

import hashlib

from pyinfra.facts.files import Sha256File

from rigforge import drift
from rigforge.layout import HostLayout
from roles import site
from roles.facts import probe
from roles.facts.files import JsonFile
from roles.facts.system import OsRelease

ANSWERS = {  # what a fresh rig answers, per fact class name
    "NvidiaGpus": [],
    "OsRelease": {"id": "debian", "version_id": "13", "codename": "trixie"},
    "GitCheckout": None,
    "WeightsState": {"stamp": None, "files": {}},
    "Sha256File": None,
    "JsonFile": None,
    "SystemdUnitEnabled": False,
    "UnitActive": "unknown",
    "NvidiaModuleVersion": None,
    "NvidiaRunningDriver": None,
    "DebInstalledVersion": None,
    "BootCaps": {},
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
    plan, problems = site.plan_for("rig1", {"rigforge_variant": "dual-turbo", **data}, deployable=False)
    assert plan, problems
    return drift.RigContext(name="rig1", data=site.host_data(data), plan=plan, layout=plan.layout,
                            variant_name="dual-turbo", manifest=manifest)  # fmt: skip


def test_every_fact_the_checks_read_is_in_the_one_probe():
    for manifest in (None, {"variant": "dual-turbo", "unit": "rigforge-vllm@dual-turbo.service"}):
        ctx = context(manifest, rigforge_manage_services=True)
        obs = Recording()
        drift.checks(obs, ctx)
        drift.rig_drift(obs, ctx)
        asked = {probe.fact_key(cls, kwargs) for cls, kwargs in drift.requests(ctx, "debian")}
        assert obs.read and set(obs.read) <= asked, set(obs.read) - asked


def test_a_hand_edited_file_is_named_and_no_rendered_file_holds_the_token(monkeypatch):
    monkeypatch.setenv("RIGFORGE_HF_TOKEN", "hf_" + "t" * 34)
    ctx = context()
    plan = ctx.plan
    assert plan.token and not any(plan.token in text for text in plan.files.values())
    compose = f"{plan.layout.serve_dir}/docker-compose.yml"
    env = f"{plan.layout.serve_dir}/.env"
    as_planned = {
        probe.fact_key(Sha256File, {"path": path}): hashlib.sha256(text.encode()).hexdigest()
        for path, text in drift.managed_files(plan).items()
    }
    assert drift.files(Recording(as_planned), plan) == []
    edited = {**as_planned, probe.fact_key(Sha256File, {"path": compose}): "0" * 64}
    assert drift.files(Recording(edited), plan) == [
        f"{compose} differs from what rigforge renders (edited by hand? re-run the deploy)"
    ]
    missing = {k: v for k, v in as_planned.items() if env not in k}
    assert drift.files(Recording(missing), plan) == [f"{env} is missing"]


def test_daemon_json_is_compared_on_the_key_rigforge_owns_only():
    ctx = context()
    daemon = probe.fact_key(JsonFile, {"path": HostLayout().daemon_json})
    mine = {"runtimes": {"nvidia": {"args": [], "path": "nvidia-container-runtime"}}}
    assert drift.runtime(Recording({daemon: {**mine, "log-level": "warn"}}), ctx).status == "pass"
    other = {"runtimes": {"nvidia": {"path": "/usr/local/bin/x"}}}
    assert drift.runtime(Recording({daemon: other}), ctx).status == "fail"
    assert drift.runtime(Recording({daemon: None}), ctx).status == "fail"
    assert probe.fact_key(OsRelease, {}) in {probe.fact_key(c, k) for c, k in drift.requests(ctx, "debian")}
