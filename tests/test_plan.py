"""Tier 2: the plan (roles/site.py `prepare`) on pyinfra's @fake hosts, through pyinfra's real prepare/execute.

Every bad knob is refused in one message naming the host and the host-data key, as the host's first operation
(nothing it runs changes anything); a good host in the same run carries on; a value that cannot even be parsed
(`serving_health_timeout: "ten minutes"`) does not abort the run for the others. The token is needed only while
a gated asset is not stamped.
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from pyinfra.api import Config, Inventory, State
from pyinfra.api.connect import connect_all
from pyinfra.api.deploy import add_deploy
from pyinfra.api.exceptions import PyinfraError
from pyinfra.api.operations import run_ops
from pyinfra.api.state import StateStage
from pyinfra.operations import server

import rigforge.model.knobs.gpu_power
import rigforge.model.knobs.serving
import rigforge.model.knobs.weights
from rigforge.layout import STAMP, HostLayout
from rigforge.model import fleet
from rigforge.model.catalog import CatalogError
from rigforge.model.fleet import Plan, resolve, variant_problems
from rigforge.model.pins import default_lock_path, load_lock
from rigforge.model.schema import Settings, SettingsError, apply_overrides
from roles import site

SHA = "a" * 40
GIT = ("vllm-src", "genesis", "club-3090")
DRAFT_FILE = {"path": "model.safetensors", "size": 10, "sha256": "d" * 64}


def lock_file(tmp_path, name="lock", **hf_changes) -> str:
    data = {
        "version": 1,
        "image": {"ref": "vllm/vllm-openai:nightly", "digest": None},
        "git": {name: {"url": f"git://h/{name}.git", "ref": "b", "commit": "b" * 40} for name in GIT},
        "hf": {
            "autoround-int4": {"repo": "Lorbus/q", "revision": SHA, "gated": False, "files": [DRAFT_FILE]},
            "dflash-draft": {"repo": "z-lab/Qwen3.6-27B-DFlash", "revision": SHA, "gated": True, "files": [DRAFT_FILE]},
            "carnice": {"repo": "w/Carnice", "revision": SHA, "gated": False, "files": [DRAFT_FILE]},
            **hf_changes,
        },
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def stamped(dirname: str) -> dict:
    """Fake WeightsState answers for an asset whose stamp matches its file (so it needs no fetch)."""
    stamp = {"revision": SHA, "files": {"model.safetensors": {"size": 10, "mtime_ns": 5_000_000_000, **DRAFT_FILE}}}
    del stamp["files"]["model.safetensors"]["path"]
    lines = [json.dumps(stamp), "--files--", "10 5.0 model.safetensors", "--staging--"]
    return {f"{dirname}/.rigforge-stamp.json": lines}


def run_site(
    tmp_path, hosts: dict[str, dict], variant="dual-turbo", env_token=None, monkeypatch=None, groups=None, before=None
):
    """prepare() then a changing operation on each host (a host in the group `registry` serves the registry
    first, as provision() does); returns (state, {host: executed commands}). `groups`: {group: [host names]}."""
    lock = lock_file(tmp_path)
    inventory = Inventory(
        (
            [
                (
                    f"@fake/{name}",
                    {
                        "fake_delay": 0,
                        "fake_delay_jitter": 0,
                        "rigforge_lock": lock,
                        "hf_endpoint": "http://127.0.0.1:9",
                        **data,
                    },
                )  # no hub reached: a closed port
                for name, data in hosts.items()
            ],
            {},
        ),
        **{group: ([f"@fake/{n}" for n in names], {}) for group, names in (groups or {}).items()},
    )
    state = State(inventory, Config(), check_for_changes=True)
    connect_all(state)
    state.set_stage(StateStage.Prepare)
    plans = {}

    def deploy():
        from pyinfra import host

        if before:
            before(host)
        fl = site.the_fleet(variant)
        if not site.serve_the_registry(fl) or not fleet.is_rig(host):
            return
        plan = site.prepare(fl)
        plans[host.name] = plan
        if plan:
            site.trust_the_registry(plan, fl)
            site.power_warnings(plan)  # roles/site.py says them once preflight passed
            server.shell(name="Change something", commands=["touch /rigforge-was-here"])

    add_deploy(state, deploy)
    state.set_stage(StateStage.Execute)
    try:
        run_ops(state)
    except PyinfraError as exc:
        assert "No hosts remaining" in str(exc)
    ran = {name: state.inventory.get_host(f"@fake/{name}").connector.executed_commands for name in hosts}
    return state, ran, plans


@pytest.fixture(autouse=True)
def no_token_in_env(monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("RIGFORGE_HF_TOKEN", raising=False)


def errors(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR)


@pytest.mark.parametrize(
    "data, expect",
    [
        ({"serving_health_timeout": "ten minutes"}, "serving_health_timeout must be a whole number of seconds in"),
        ({"serving_health_timeout": -1}, "serving_health_timeout must be a whole number of seconds in 10..86400"),
        ({"serving_max_model_len": -5}, "serving_max_model_len must be an integer in 1..1048576, got -5"),
        ({"serving_max_num_seqs": 0}, "serving_max_num_seqs must be an integer in 1..1024, got 0"),
        ({"serving_port": 70000}, "serving_port must be a port number in 1..65535, got 70000"),
        ({"nvidia_driver_packages": ["nvidia-driver-580-open"]}, "nvidia_driver_packages is no longer read"),
        ({"gpu_power_limit_w": 5000}, "gpu_power_limit_w must be whole watts in 100..600, got 5000"),
        ({"gpu_power_limit_w": 90}, "gpu_power_limit_w must be whole watts in 100..600, got 90"),
        ({"gpu_power_limits": {1: 900}}, "gpu_power_limits must be a mapping of GPU index (0..15) to whole watts"),
        ({"gpu_power_limits": {5: 250}}, "gpu_power_limits names GPU(s) [5] but this rig has 2 GPU(s)"),
        ({"serving_image": 'vllm/vllm-openai:x"; rm -rf /'}, "serving_image must be an image reference"),
        ({"rigforge_root": "/opt/rf;x"}, "rigforge_root must be an absolute path of letters, digits"),
        ({"rigforge_root": "opt/rigforge"}, "rigforge_root must be an absolute path"),
        ({"rigforge_root": "/"}, "rigforge_root must be a directory of its own, not the system directory /"),
        ({"rigforge_root": "/usr/"}, "not the system directory /usr (e.g. /opt/rigforge)"),
        ({"rigforge_root": "/srv"}, "not the system directory /srv (e.g. /srv/rigforge)"),
        ({"rigforge_root": "/var/lib/docker"}, "outside /var/lib/docker, Docker's default data-root (e.g. /opt/"),
        ({"serving_model_dir": "/var/lib/docker/m"}, "serving_model_dir must be a directory of its own outside"),
        ({"rigforge_root": "/etc/rigforge"}, "outside /etc/rigforge, rigforge's own config dir"),
        ({"rigforge_root": "/etc/systemd"}, "outside /etc/systemd, systemd's config (e.g. /opt/rigforge)"),
        ({"serving_model_dir": "/proc/x"}, "outside /proc, the kernel's process file system (e.g. /opt/rigforge)"),
        ({"rigforge_root": "/tmp"}, "outside /tmp, cleared at boot or by systemd-tmpfiles (e.g. /opt/rigforge)"),
        ({"rigforge_root": "/tmp/rigforge"}, "outside /tmp, cleared at boot"),
        ({"serving_model_dir": "/boot/models"}, "outside /boot, the kernels and boot loader"),
        ({"rigforge_root": "/run/rigforge"}, "outside /run, a tmpfs emptied at every boot"),
        ({"rigforge_root": "/sys/x"}, "outside /sys,"),
        ({"rigforge_root": "/dev/shm/x"}, "outside /dev,"),
        ({"serving_model_dir": "/var/lib"}, "serving_model_dir must be a directory of its own"),
        ({"serving_port": 22}, "serving_port 22 is this rig's SSH port"),
        ({"serving_port": 443}, "serving_port 443 is below 1024"),
        ({"serving_model_dir": "/srv/my models"}, "serving_model_dir must be an absolute path"),
        ({"weights_source": "torrent"}, "weights_source must be one of: hub, controller; got 'torrent'"),
        ({"rigforge_manage_services": "yes"}, "rigforge_manage_services must be true or false, got 'yes'"),
        ({"serving_kv_cache_dtype": "int3"}, "serving_kv_cache_dtype must be one of: auto, fp8"),
        ({"hf_endpoint": "ftp://x"}, "hf_endpoint must be an http(s) URL"),
        (
            {"rigforge_variant": "dual"},
            "this entry point deploys dual-turbo but host data sets rigforge_variant='dual'",
        ),
        ({"rigforge_lock": "/nonexistent/lock.yaml"}, "/nonexistent/lock.yaml"),
    ],
)
def test_bad_knob_refuses_only_its_host_before_anything_runs(tmp_path, caplog, data, expect):
    state, ran, plans = run_site(tmp_path, {"bad": data, "good": {}})
    assert {h.name for h in state.failed_hosts} == {"@fake/bad"}
    assert "touch /rigforge-was-here" not in ran["bad"], "a refused host ran commands"
    assert "touch /rigforge-was-here" in ran["good"]
    text = errors(caplog)
    assert "rigforge refused on @fake/bad:" in text and expect in text, text
    assert "Nothing was changed on this host." in text


def test_every_problem_in_one_message(tmp_path, caplog):
    bad = {"serving_port": "http", "serving_max_num_seqs": 0, "weights_source": "torrent", "rigforge_root": "/a b"}
    state, ran, _ = run_site(tmp_path, {"bad": bad, "good": {}})
    (message,) = [r.getMessage() for r in caplog.records if "rigforge refused" in r.getMessage()]
    for key in ("serving_port", "serving_max_num_seqs", "weights_source", "rigforge_root"):
        assert f"  - {key} must be" in message
    assert "setting 'port'" not in message  # host-data names, not internal ones


def test_a_bad_knob_and_an_unknown_variant_come_in_one_refusal():
    for entry, data in ((None, {"rigforge_variant": "dual-tubro"}), ("dual-tubro", {})):
        plan, problems = fleet.plan_for("r", {**data, "gpu_power_limit_w": 50}, entry)
        assert plan is None
        assert any("gpu_power_limit_w must be whole watts in 100..600, got 50" in p for p in problems), problems
        assert any("unknown variant 'dual-tubro'" in p for p in problems), problems
    plan, problems = fleet.plan_for("r", {"serving_port": 22, "serving_max_num_seqs": 0}, "dual-turbo")
    assert plan is None and len(problems) == len(set(problems)) == 2, problems


def test_dflash_with_kv_override_names_the_host_data_key(tmp_path, caplog):
    state, ran, _ = run_site(tmp_path, {"r": {"serving_kv_cache_dtype": "fp8_e5m2"}}, variant="dual-dflash")
    assert "touch /rigforge-was-here" not in ran["r"]
    assert "serving_kv_cache_dtype cannot be used with dual-dflash" in errors(caplog)


def test_gated_asset_needs_the_token_only_until_it_is_stamped(tmp_path, caplog, monkeypatch):
    fresh = {}
    converged = {"fake_responses": {**stamped("qwen3.6-27b-dflash"), **stamped("qwen3.6-27b-autoround-int4")}}
    state, ran, plans = run_site(tmp_path, {"fresh": fresh, "converged": converged}, variant="dual-dflash")
    assert {h.name for h in state.failed_hosts} == {"@fake/fresh"}
    assert "z-lab/Qwen3.6-27B-DFlash is gated, not yet fetched, and no HF token is set" in errors(caplog)
    assert "touch /rigforge-was-here" in ran["converged"]
    monkeypatch.setenv("RIGFORGE_HF_TOKEN", "hf_secret123")
    caplog.clear()
    state, ran, plans = run_site(tmp_path, {"fresh": fresh}, variant="dual-dflash")
    assert not state.failed_hosts and plans["@fake/fresh"].token == "hf_secret123"
    assert not any("hf_secret123" in text for text in plans["@fake/fresh"].files.values())  # only the download
    assert "hf_secret123" not in repr(plans["@fake/fresh"])
    expect = "could not check the HF token with http://127.0.0.1:9 (ConnectionError); the rig's download tries it"
    assert expect in caplog.text


class GatedHub(BaseHTTPRequestHandler):
    """A hub that lets only `hf_right` HEAD its files, as the Hub answers a gated repo."""

    def do_HEAD(self):
        self.send_response(200 if self.headers.get("Authorization") == "Bearer hf_right" else 403)
        self.end_headers()

    def log_message(self, *args):
        pass


def refusals(state) -> list[str]:
    """The names of the refusal operations a run queued."""
    names = (name for op_hash in state.get_op_order() for name in state.get_op_meta(op_hash).names)
    return [name for name in names if name.startswith("Refuse ")]


def test_a_refused_token_is_found_on_the_controller_before_anything_changes(tmp_path, caplog, monkeypatch):
    hub = ThreadingHTTPServer(("127.0.0.1", 0), GatedHub)
    threading.Thread(target=hub.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{hub.server_address[1]}"
    try:
        monkeypatch.setenv("RIGFORGE_HF_TOKEN", "hf_wrong")
        state, ran, plans = run_site(tmp_path, {"r": {"hf_endpoint": endpoint}}, variant="dual-dflash")
        assert {h.name for h in state.failed_hosts} == {"@fake/r"} and "touch /rigforge-was-here" not in ran["r"]
        assert f"the HF token was refused by {endpoint} for the gated z-lab/Qwen3.6-27B-DFlash (HTTP 403)" in errors(
            caplog
        )
        assert "hf_wrong" not in caplog.text
        assert refusals(state) == ["Refuse @fake/r: no usable HF token for the gated weights"]  # not 'host data'
        state, _, _ = run_site(tmp_path, {"r": {"hf_endpoint": endpoint, "serving_port": 80}}, variant="dual-dflash")
        assert refusals(state) == ["Refuse @fake/r: 1 problem(s) in host data"]  # a plan first: then the token
        monkeypatch.setenv("RIGFORGE_HF_TOKEN", "hf_right")
        state, ran, plans = run_site(tmp_path, {"r": {"hf_endpoint": endpoint}}, variant="dual-dflash")
        assert not state.failed_hosts and "touch /rigforge-was-here" in ran["r"]
    finally:
        hub.shutdown()


def test_unresolved_lock_entry_refuses_with_what_to_do(tmp_path, caplog):
    unresolved = {"repo": "a/b", "revision": None, "gated": False, "files": []}
    lock = lock_file(tmp_path, "unresolved", carnice=unresolved)
    state, ran, _ = run_site(tmp_path, {"r": {"rigforge_lock": lock}, "good": {}}, variant="carnice-bf16mtp")
    assert "touch /rigforge-was-here" not in ran["r"]
    text = errors(caplog)
    assert "hf.carnice" in text and "run `rigforge lock` on a networked controller" in text


def test_plan_holds_the_layout_caps_and_pins(tmp_path):
    data = {"rigforge_root": "/srv/rf", "gpu_power_limits": {1: 250}, "serving_port": 8111}
    state, ran, plans = run_site(tmp_path, {"r": data})
    plan = plans["@fake/r"]
    assert isinstance(plan, Plan) and plan.variant.name == "dual-turbo" and plan.port == 8111
    assert dict(plan.caps) == {0: 230, 1: 250}
    layout = plan.layout
    assert layout.serve_dir == "/srv/rf/serve/dual-turbo" and layout.src("genesis") == "/srv/rf/src/genesis"
    assert layout.vllm_unit == "rigforge-vllm@dual-turbo.service" and layout.rig_json == "/etc/rigforge/rig.json"
    assert f"{layout.asset_dir('d')}/{STAMP}" == "/srv/rf/models/d/.rigforge-stamp.json"  # as hfweights spells it
    assert [p.name for p in plan.sources] == ["vllm-src", "genesis", "club-3090"]
    with pytest.raises(AttributeError):
        plan.host = "other"  # frozen


def test_caps_cover_the_gpus_the_pci_bus_shows(tmp_path):
    pci = [f"pci 0000:0{i}:00.0 0x2204" for i in (1, 2, 3)] + ["end"]
    three = {"fake_responses": {"/sys/bus/pci/devices": pci}}
    state, ran, plans = run_site(tmp_path, {"r": three})
    assert dict(plans["@fake/r"].caps) == {0: 230, 1: 230, 2: 230}


def test_variant_choice_rules():
    assert variant_problems("dual", None) == ("dual", [])
    assert variant_problems("dual", "dual") == ("dual", [])
    assert variant_problems(None, "dual-turbo") == ("dual-turbo", [])
    assert "rigforge_variant is not set" in variant_problems(None, None)[1][0]
    assert "deploy/site.py" in variant_problems("dual", "dual-turbo")[1][0]
    with pytest.raises(CatalogError, match="unknown variant 'dual-tubro'; choose one of: dual, dual-turbo"):
        resolve("dual-tubro", load_lock(default_lock_path()), opt_in=False)


def test_role_validators_are_pure_and_name_host_data_keys():
    assert rigforge.model.knobs.gpu_power.validate({"gpu_power_limit_w": 230, "gpu_power_limits": {}}) == []
    assert rigforge.model.knobs.serving.validate(rigforge.model.knobs.serving.DEFAULTS) == []
    (problem,) = rigforge.model.knobs.weights.validate(
        {**rigforge.model.knobs.weights.DEFAULTS, "hf_token": "has space"}
    )
    assert problem.startswith("hf_token must be") and "has space" not in problem  # secrets are not echoed


def test_render_set_refuses_out_of_range_values():
    with pytest.raises(SettingsError, match="setting 'power_limit_w' must be whole watts in 100..600, got '5000'"):
        apply_overrides(Settings(), {"power_limit_w": "5000"})
    with pytest.raises(SettingsError, match="setting 'image' must be an image reference"):
        apply_overrides(Settings(), {"image": "x' y"})
    assert HostLayout(root="/r").models == "/r/models"


def test_a_rigforge_dir_below_a_system_dir_is_allowed():
    for data in (
        {"rigforge_root": "/home/ai/rigforge"},
        {"serving_model_dir": "/var/lib/models"},
        {"serving_port": 80, "serving_allow_privileged_port": True},
        {"serving_port": 2200},
    ):
        plan, problems = fleet.plan_for("r", data, "dual-turbo", deployable=False)
        assert plan and not problems, problems
    plan, problems = fleet.plan_for("r", {"serving_port": 2200, "ssh_port": 2200}, "dual-turbo", deployable=False)
    assert problems == [
        "serving_port 2200 is this rig's SSH port; choose another, e.g. 8011 (the variants use 8010-8014)"
    ]


def test_a_cap_outside_the_recipes_measured_range_warns_during_the_deploy_and_goes_on(tmp_path, caplog, monkeypatch):
    """docs/HARDWARE.md of the recipe repo: TP=2 flat from 220 to 330 W; 350 W is kept, with a warning."""
    monkeypatch.setenv("RIGFORGE_RECIPES", str(Path(__file__).parent / "fixtures" / "club-3090-4a29ab57"))
    caplog.set_level(logging.WARNING)
    state, ran, plans = run_site(tmp_path, {"hot": {"gpu_power_limit_w": 350}, "default": {}})
    assert not state.failed_hosts and "touch /rigforge-was-here" in ran["hot"]
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "power cap" in r.getMessage()]
    assert len(warned) == 1 and "@fake/hot: WARNING: power cap 350 W (GPU 0, 1)" in warned[0], warned
    assert "docs/HARDWARE.md" in warned[0] and plans["@fake/hot"].caps == {0: 350, 1: 350}
    # no driver answers on these fake rigs: the cards' own range is still to be checked, and the warning says so
    assert warned[0].endswith("; kept as set if the cards' own range allows it (checked once the driver answers)")


def test_roots_inside_the_data_root_the_rigs_daemon_json_sets_are_refused():
    """Docker's default data-root is refused with the host data (rigforge/model/schema.py); one that the rig's own
    daemon.json moves elsewhere is refused in preflight, for rigforge_root and the model dir alike."""
    from rigforge.layout import HostLayout
    from rigforge.model.hardware import data_root_of, roots_inside

    assert data_root_of(None) == data_root_of(["{}"]) == data_root_of(["{ broken"]) == "/var/lib/docker"
    assert data_root_of(['{"data-root": "/srv/docker/"}']) == "/srv/docker"
    assert roots_inside(HostLayout(root="/srv/rf"), "/srv/docker") == []
    (problem,) = roots_inside(HostLayout(root="/srv/docker/rf"), "/srv/docker")
    assert problem == (
        "rigforge_root /srv/docker/rf is inside /srv/docker, Docker's data-root set in /etc/docker/daemon.json; "
        "choose a directory of its own outside it (e.g. /opt/rigforge)"
    )
    (problem,) = roots_inside(HostLayout(model_dir="/srv/docker/models"), "/srv/docker")
    assert problem.startswith("serving_model_dir /srv/docker/models is inside /srv/docker, Docker's data-root")


def test_a_changed_root_names_the_old_tree_its_size_and_how_to_remove_it():
    from rigforge.layout import HostLayout
    from rigforge.model.hardware import changed_roots

    sizes = {"/opt/rigforge": 52_600_000_000, "/data/models": 3_000_000_000}
    size_of = sizes.get
    old = {"root": "/opt/rigforge", "models": "/opt/rigforge/models"}
    assert changed_roots(HostLayout(), old, size_of) == []  # unchanged
    assert changed_roots(HostLayout(root="/srv/rf"), {"variant": "dual"}, size_of) == []  # an older rig.json
    (warning,) = changed_roots(HostLayout(root="/srv/rf"), old, size_of)
    assert warning == (
        "rigforge_root changed: /opt/rigforge, the earlier deploy's (recorded in /etc/rigforge/rig.json), holds "
        "52.6 GB and is no longer used; rigforge leaves it as it is; once the rig serves from the new one, remove it "
        "with: sudo rm -rf /opt/rigforge"
    )
    assert changed_roots(HostLayout(root="/srv/rf"), {"root": "/srv/gone"}, size_of) == []  # removed already
    (warning,) = changed_roots(HostLayout(root="/opt/rigforge/new"), old, size_of)
    assert "this run's /opt/rigforge/new and /opt/rigforge/new/models are inside it: remove the rest" in warning
    assert "rm -rf" not in warning
    (warning,) = changed_roots(HostLayout(), {"root": "/opt/rigforge", "models": "/data/models"}, size_of)
    assert warning.startswith("serving_model_dir changed: /data/models, the earlier deploy's")
    assert "3.0 GB" in warning and warning.endswith("sudo rm -rf /data/models")


def test_a_bad_registry_setting_refuses_the_registry_host_only_and_the_rigs_are_warned(tmp_path, caplog):
    state, ran, plans = run_site(
        tmp_path,
        {"rig1": {}, "rig2": {}, "reg": {"registry_port": 0}},
        groups={"rigs": ["rig1", "rig2"], "registry": ["reg"]},
    )
    assert {h.name for h in state.failed_hosts} == {"@fake/reg"}
    assert plans["@fake/rig1"] and plans["@fake/rig2"]
    assert all("touch /rigforge-was-here" in ran[r] for r in ("rig1", "rig2"))
    text = errors(caplog)
    assert "rigforge refused the fleet registry on @fake/reg" in text and "registry_port must be" in text, text
    assert "@fake/rig1" not in text and "@fake/rig2" not in text, text
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    for rig in ("rig1", "rig2"):  # each rig is told the registry is left out, and why
        assert any(
            f"@fake/{rig}: the fleet registry on @fake/reg is left out (that host is refused): registry_port" in w
            for w in warned
        ), warned


def test_a_fleet_builds_each_rigs_plan_once_and_renders_each_file_once_per_host(tmp_path, monkeypatch):
    """Issue 31: on 3 rigs and gw (the gateway and the fleet registry), one run builds each rig's plan once (the
    gateway's backends and the registry's fill list are read from the fleet, never rebuilt) and renders each
    rig's files once; the fleet hosts build none."""
    from collections import Counter

    import rigforge.model.fleet as planner
    import rigforge.model.render as render

    built, rendered = Counter(), Counter()
    real_build, real_power = planner.build_plan, render.render_power_unit

    def counting_build(name, *args, **kwargs):
        built[name.split("/")[-1]] += 1
        return real_build(name, *args, **kwargs)

    def counting_power(*args, **kwargs):
        rendered["power unit"] += 1
        return real_power(*args, **kwargs)

    monkeypatch.setattr(planner, "build_plan", counting_build)
    monkeypatch.setattr(render, "render_power_unit", counting_power)
    gateways = []

    def gateway_too(host):
        if "gateway" in host.groups:
            gateways.append(site.gateway_plan(site.the_fleet("dual-turbo")))

    state, ran, plans = run_site(
        tmp_path,
        {"rig1": {}, "rig2": {}, "rig3": {}, "gw": {"registry_insecure": True}},
        groups={"rigs": ["rig1", "rig2", "rig3"], "gateway": ["gw"], "registry": ["gw"]},
        before=gateway_too,
    )
    assert not state.failed_hosts
    assert dict(built) == {"rig1": 1, "rig2": 1, "rig3": 1}
    assert rendered["power unit"] == 3
    ((gw, problems),) = gateways
    assert problems == [] and [s.name for b in gw.backends for s in b.servers] == [
        "@fake/rig1",
        "@fake/rig2",
        "@fake/rig3",
    ]
    assert all(plans[f"@fake/rig{i}"] for i in (1, 2, 3))


def nvidia_smi_rows(count: int) -> list[str]:
    """`count` RTX 3090s as nvidia-smi's --query-gpu CSV lists them (the fake connector's answer)."""
    return [
        f"{i}, GPU-{i:08d}, NVIDIA GeForce RTX 3090, 00000000:0{i + 1}:00.0, 24576, 1, 350.00, 350.00, 100.00, "
        "350.00, Enabled, 580.95.05, 8.6"
        for i in range(count)
    ]


def test_a_fleet_with_mixed_gpu_counts_builds_each_rigs_plan_once(tmp_path, monkeypatch):
    """Issue 48: on 3 @fake rigs showing 2, 1 and 4 GPUs, one run builds each rig's plan once (rigforge/model/fleet.py
    `build_plan`); the rigs whose count differs from the variant's get their caps and the files rendered from the
    count from the cheap pure step `for_cards`: the power units, and on the 4-card rig the serve files that pin the
    TP=2 variant to cards 0 and 1 (hardware.serving_env)."""
    from collections import Counter

    import rigforge.model.catalog as catalog
    import rigforge.model.fleet as planner
    import rigforge.model.render as render

    built, rendered = Counter(), Counter()
    real_build, real_units = planner.build_plan, render.units

    def counting_build(name, *args, **kwargs):
        built[name.split("/")[-1]] += 1
        return real_build(name, *args, **kwargs)

    def counting_units(settings, layout, gpu_count):
        rendered[gpu_count] += 1
        return real_units(settings, layout, gpu_count)

    monkeypatch.setattr(planner, "build_plan", counting_build)
    monkeypatch.setattr(render, "units", counting_units)
    monkeypatch.setattr(catalog, "units", counting_units)  # the seed adapter's own name for it
    hosts = {
        f"rig{i}": {"fake_responses": {"--query-gpu=": nvidia_smi_rows(count)}} for i, count in ((1, 2), (2, 1), (3, 4))
    }
    state, ran, plans = run_site(tmp_path, hosts)
    assert dict(built) == {"rig1": 1, "rig2": 1, "rig3": 1}
    assert {name: sorted(plan.caps) for name, plan in plans.items()} == {
        "@fake/rig1": [0, 1],
        "@fake/rig2": [0],
        "@fake/rig3": [0, 1, 2, 3],
    }
    assert rendered == {2: 3, 1: 1, 4: 1}  # each rig's units at the variant's count, then the two that differ
    unit = plans["@fake/rig3"].files[render.POWER_UNIT]
    assert all(f"-i {i} " in unit for i in range(4)), unit
    pinned = [name for name, text in plans["@fake/rig3"].files.items() if "CUDA_VISIBLE_DEVICES" in text]
    assert pinned and all("0,1" in plans["@fake/rig3"].files[name] for name in pinned), pinned
    assert not any("CUDA_VISIBLE_DEVICES" in text for text in plans["@fake/rig1"].files.values())


def answers(recorded: dict[str, str], gpus: dict[str, int]):
    """An Observed class (rigforge/observe/hosts.py) answering as a provisioned rig would, asking no host: its manifest
    records `recorded[host]` (else host data's variant), nvidia-smi lists `gpus[host]` GPUs (else 2)."""
    gpu = {"index": 0, "name": "NVIDIA GeForce RTX 3090", "memory_total": 24576, "power_limit": 230}

    class Answers:
        def __init__(self, host, requests=()):
            self.host = host

        def get_fact(self, cls, **kwargs):
            name = self.host.name
            return {
                "NvidiaGpus": [{**gpu, "index": i} for i in range(gpus.get(name, 2))],
                "OsRelease": {"id": "debian", "version_id": "13", "codename": "trixie"},
                "JsonFile": {"variant": recorded.get(name, self.host.data.get("rigforge_variant"))}
                if kwargs.get("path", "").endswith("rig.json")
                else None,
                "PowerCapUnits": {},
                "WeightsState": {"stamp": None, "files": {}},
                "ServiceState": {"active": "unknown", "sub": "", "result": "", "restarts": 0, "enabled": ""},
                "BootCaps": {},
                "ComposeImages": [],
            }.get(cls.__name__)

    return Answers


@pytest.mark.parametrize("command", ["status", "verify"])
def test_status_and_verify_build_each_rigs_plan_once(tmp_path, monkeypatch, command, capsys):
    """Issue 31: status and verify build the fleet once (rigforge/model/fleet.py `build`, before the rigs are read in
    parallel) and take each rig's plan from it: on 3 rigs and a gateway host, each rig's plan is built once when
    the rigs are as the inventory says; a rig whose manifest records another variant is built again for what it
    runs; one that shows another GPU count is not (fleet.for_cards)."""
    import argparse
    import importlib
    from collections import Counter
    from types import SimpleNamespace

    import rigforge.model.fleet as planner
    from rigforge.observe import hosts, inventory

    built, real_build = Counter(), planner.build_plan
    monkeypatch.setattr(
        planner, "build_plan", lambda name, *a, **kw: built.update([name]) or real_build(name, *a, **kw)
    )
    rig = {"rigforge_lock": lock_file(tmp_path), "rigforge_variant": "dual-turbo", "rigforge_manage_services": False}
    fleet_hosts = Inventory(([(f"rig{i}", rig) for i in (1, 2, 3)] + ["gw"], {}), gateway=(["gw"], {}))
    monkeypatch.setattr(inventory, "open_inventory", lambda path: SimpleNamespace(inventory=fleet_hosts))
    before = []  # the plans built before the rigs are read

    def for_each_host(state, fn):
        before.append(dict(built))
        return {h.name: fn(h) for h in state.inventory}

    monkeypatch.setattr(inventory, "for_each_host", for_each_host)
    monkeypatch.setattr(inventory, "sh", lambda host, command: "")  # nothing answers on the hosts
    run = importlib.import_module(f"rigforge.cli.{command}").run
    args = argparse.Namespace(inventory="fleet.py", json=True)

    monkeypatch.setattr(hosts, "Observed", answers({}, {}))
    assert run(args) in (0, 1)
    assert before == [dict(built)] == [{"rig1": 1, "rig2": 1, "rig3": 1}]  # by the fleet; reading the rigs built none
    out = json.loads(capsys.readouterr().out)
    rows = out if command == "status" else [{"host": h, **r} for h, r in out["hosts"].items()]
    assert [r["host"] for r in rows] == ["rig1", "rig2", "rig3", "gw"] and not any(r["error"] for r in rows)

    built.clear()
    monkeypatch.setattr(hosts, "Observed", answers({"rig2": "dual"}, {"rig3": 1}))
    run(args)
    assert dict(built) == {"rig1": 1, "rig2": 2, "rig3": 1}  # rig2 for "dual" (what it runs); rig3's one GPU: for_cards
    if command == "status":
        rows = {r["host"]: r for r in json.loads(capsys.readouterr().out)}
        assert (rows["rig2"]["variant"], len(rows["rig3"]["gpus"]), rows["rig1"]["variant"]) == (
            "dual",
            1,
            "dual-turbo",
        )
