"""Tier 2: the host roles' operations against faked facts.

Hosts use pyinfra's own `@fake` connector: every fact command gets a canned answer (matched by
substring), nothing runs anywhere, and the connector records each command it was asked to execute.
Deploys go through pyinfra's real prepare/execute machinery (State, add_deploy, run_ops), so a host that
fails in preflight is dropped by pyinfra itself and its later operations never execute.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import replace

import pytest
from pyinfra.api import Config, FileUploadCommand, Inventory, State
from pyinfra.api.connect import connect_all
from pyinfra.api.deploy import add_deploy
from pyinfra.api.exceptions import PyinfraError
from pyinfra.api.operations import run_ops
from pyinfra.api.state import StateStage
from pyinfra.context import ctx_host, ctx_state
from pyinfra.operations import server
from support import render_variant

from rigforge.layout import NVIDIA_RUNTIME, HostLayout
from rigforge.model import fleet, hardware, packages
from rigforge.model.catalog import load_catalog
from rigforge.model.fleet import Plan
from rigforge.model.jsonmerge import merged_text
from rigforge.model.knobs.nvidia_driver import NvidiaDriver
from rigforge.model.knobs.roles import RoleKnobs
from rigforge.model.render import render_power_unit
from rigforge.model.schema import Settings
from roles import docker_engine, gpu_power, nvidia_driver, preflight
from roles.operations import apt_repo, checks, nvidia, shown

OS = {
    "ubuntu2204": 'ID=ubuntu\nVERSION_ID="22.04"\nVERSION_CODENAME=jammy',
    "ubuntu2404": 'ID=ubuntu\nVERSION_ID="24.04"\nVERSION_CODENAME=noble',
    "debian12": 'ID=debian\nVERSION_ID="12"\nVERSION_CODENAME=bookworm',
    "debian13": 'ID=debian\nVERSION_ID="13"\nVERSION_CODENAME=trixie',
    "debian11": 'ID=debian\nVERSION_ID="11"\nVERSION_CODENAME=bullseye',
}


def make_plan(variant="dual-turbo", settings=None, caps=None, **data) -> Plan:
    """A plan for one role on a fake host (not validated: the role's own behaviour is under test)."""
    v = load_catalog().variants[variant]
    settings = settings or Settings()
    return Plan(
        host="r",
        variant=v,
        settings=settings,
        layout=HostLayout(root=settings.root, model_dir=settings.model_dir, variant=v.name),
        sources=(),
        assets=(),
        caps=caps or {i: settings.power_limit_w for i in range(v.gpus)},
        knobs=RoleKnobs.of(data),
        files=render_variant(v, settings, len(caps) if caps else None),
        locked_image=settings.image or v.image,
    )


def planned(role):
    """`role` (a role's deploy taking the plan) run with the host's plan from its host data, as roles/site.py
    builds it; a host whose data the plan refuses gets no operations (preflight names the problems)."""

    def run():
        from pyinfra import host

        plan, _ = fleet.plan_for(host.name, host.data, "dual-turbo", deployable=False)
        if plan:
            role(plan)

    return run


def power_plan(watts=230) -> Plan:
    return make_plan(settings=Settings(power_limit_w=watts))


def gpu_row(index, limit=350.0, min_w=100.0, max_w=350.0, mib=24576, pm="Enabled", name="NVIDIA GeForce RTX 3090"):
    return (
        f"{index}, GPU-{index:08d}, {name}, 00000000:0{index + 1}:00.0, {mib}, 1, {limit:.2f}, 350.00, "
        f"{min_w:.2f}, {max_w:.2f}, {pm}, 580.95.05, 8.6"
    )


def rig(os="ubuntu2404", gpus=None, free_bytes=500e9, packages=(), held=(), extra=None, **data):
    """Host data for a fake rig: canned fact answers plus host data keys."""
    gpus = [gpu_row(0), gpu_row(1)] if gpus is None else gpus
    dpkg = [f"ii  {name}  {version}  amd64  stub" for name, version in packages]
    responses = {
        "cat /etc/os-release": OS[os],
        "dpkg --print-architecture": "amd64",
        "--query-gpu=": gpus,
        "stat -f": f"{int(free_bytes // 4096)} 4096",
        "mokutil": "SecureBoot disabled",
        "${db:Status-Want}": list(held),
        "dpkg -l": dpkg,
    }
    responses.update(extra or {})
    return {"fake_responses": responses, "fake_delay": 0, "fake_delay_jitter": 0, **data}


def make_state(hosts: dict[str, dict], check_for_changes=True) -> State:
    inventory = Inventory(([(f"@fake/{name}", data) for name, data in hosts.items()], {}))
    state = State(inventory, Config(), check_for_changes=check_for_changes)
    connect_all(state)
    state.set_stage(StateStage.Prepare)
    return state


def converge(hosts, deploy, *args, execute=True, check_for_changes=True, **kwargs):
    state = make_state(hosts, check_for_changes)
    add_deploy(state, deploy, *args, **kwargs)
    if execute:
        state.set_stage(StateStage.Execute)
        run_ops(state)
    return state


def host_of(state, name):
    return state.inventory.get_host(f"@fake/{name}")


def executed(state, name) -> list[str]:
    """Commands that the operations (not the facts) executed: those after the facts of prepare."""
    return host_of(state, name).connector.executed_commands


def op_commands(state, name, op, *args, **kwargs) -> list[str]:
    """The commands an operation would run on a connected fake host (its generator, evaluated now)."""
    host = host_of(state, name)
    with ctx_state.use(state), ctx_host.use(host):
        return [describe(command) for command in op._inner(*args, **kwargs)]


def uploads(state, name) -> dict[str, str]:
    """{remote path: text} of every file the host's operations would upload (evaluated against the facts)."""
    host = host_of(state, name)
    found = {}
    with ctx_state.use(state), ctx_host.use(host):
        for op_hash in state.get_op_order():
            op_data = state.ops[host].get(op_hash)
            for command in op_data.command_generator() if op_data else ():
                if isinstance(command, FileUploadCommand):
                    found[command.dest] = command.src.getvalue()
    return found


def describe(command) -> str:
    """A command as text; a preflight-style failure as "FAIL: <message>"."""
    function = getattr(command, "function", None)
    if function is checks._fail:
        return "FAIL: " + command.args[0]
    if function is shown._log:
        return "SAY: " + command.args[0]
    return f"call {function.__name__}" if function else str(command)


PREFLIGHT = hardware.Needs(
    variant="dual-turbo",
    gpus=2,
    card_mib=23000,
    dflash=False,
    disk_path="/opt/rigforge/models",
    disk_bytes=25_000_000_000,
)


def checked(data: Mapping) -> tuple[RoleKnobs, Settings]:
    """What preflight is given for host data `data`, not validated (the checks' own behaviour is under test): every
    role's knobs, and the settings the GPU checks read (the 20 GB-card override)."""
    kv_cache, share = data.get("serving_kv_cache_dtype"), data.get("serving_gpu_memory_utilization")
    return RoleKnobs.of(data), Settings(kv_cache_dtype=kv_cache, gpu_memory_utilization=share)


def site(**preflight_args):
    """A deploy shaped like roles/site.py: preflight first, then something that changes the host."""
    from pyinfra.api import deploy

    @deploy("test site")
    def _site():
        from pyinfra import host

        preflight.check(replace(PREFLIGHT, **preflight_args), *checked(fleet.host_data(host.data)))
        server.shell(name="Change something", commands=["touch /rigforge-was-here"])

    return _site


# --- preflight ---------------------------------------------------------------------------------------


def test_preflight_fails_only_the_bad_host_before_any_change(caplog):
    caplog.set_level(logging.INFO)
    state = converge({"good": rig(), "onegpu": rig(gpus=[gpu_row(0)])}, site())
    assert {h.name for h in state.failed_hosts} == {"@fake/onegpu"}
    assert "touch /rigforge-was-here" in executed(state, "good")
    assert "touch /rigforge-was-here" not in executed(state, "onegpu")
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    (message,) = [m for m in errors if "preflight failed" in m]
    assert "preflight failed on @fake/onegpu" in message
    assert "needs 2 GPUs, nvidia-smi shows 1" in message and "this rig has 1 GPU(s)" in message


@pytest.mark.parametrize("cap,word", [(90, "90 W"), (400, "400 W")])
def test_preflight_refuses_caps_outside_the_card_range(cap, word):
    state = converge({"a": rig(gpu_power_limit_w=cap), "b": rig()}, site())
    assert {h.name for h in state.failed_hosts} == {"@fake/a"}
    assert "touch /rigforge-was-here" not in executed(state, "a")
    problems = hardware.find_problems(
        {"id": "ubuntu", "version_id": "24.04"},
        [{"index": 0, "name": "RTX 3090", "memory_total": 24576, "power_min_limit": 100.0, "power_max_limit": 350.0}],
        None,
        needs=replace(PREFLIGHT, gpus=1),
        knobs=RoleKnobs.of({"gpu_power_limit_w": cap, "docker_source": "docker", "nvidia_driver_flavor": "open"}),
        settings=Settings(),
    )
    assert len(problems) == 1 and word in problems[0] and "range 100..350 W" in problems[0]
    assert "gpu_power_limit_w" in problems[0]


def test_dry_run_shows_the_refusal_in_full_and_counts_the_host_failed(caplog):
    """What `pyinfra --dry` does: prepare only. The refusal is printed in full and the host counts as failed, so
    pyinfra exits 1; nothing runs."""
    caplog.set_level(logging.INFO)
    state = converge({"onegpu": rig(gpus=[gpu_row(0)]), "good": rig()}, site(), execute=False)
    assert {h.name for h in state.failed_hosts} == {"@fake/onegpu"}
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("preflight failed on @fake/onegpu" in m and "needs 2 GPUs, nvidia-smi shows 1" in m for m in errors)
    assert not any("touch" in c for c in executed(state, "onegpu") + executed(state, "good"))


@pytest.mark.parametrize(
    "text,where",
    [
        (["{", "  // rigforge's runtime goes here", '  "log-driver": "json-file"', "}"], "line 2 column 3"),
        (["{", '  "log-driver": "json-file",', "}"], "line 3 column 1"),
        (["[1, 2]"], "top level is not a JSON object"),
    ],
)
def test_an_invalid_daemon_json_is_refused_in_preflight_in_one_line(caplog, text, where):
    """A comment or a trailing comma in /etc/docker/daemon.json: refused before the first change (dry or not), in
    one line naming the host, the file and what to do; a rig without the file, or with valid JSON, passes."""
    caplog.set_level(logging.INFO)
    valid = rig(extra={"/etc/docker/daemon.json": ['{"log-driver": "json-file"}']})
    for execute in (False, True):
        caplog.clear()
        state = converge(
            {"bad": rig(extra={"/etc/docker/daemon.json": text}), "none": rig(), "ok": valid}, site(), execute=execute
        )
        assert {h.name for h in state.failed_hosts} == {"@fake/bad"}
        assert not any("touch" in c for c in executed(state, "bad"))
        (message,) = [r.getMessage() for r in caplog.records if "preflight failed" in r.getMessage()]
        (line,) = [line for line in message.splitlines() if "daemon.json" in line]
        assert line.startswith("  - /etc/docker/daemon.json on @fake/bad is not valid JSON (") and where in line
        assert line.endswith("fix it (no comments, no trailing commas) or remove it, then re-run.")
        assert message.endswith("Nothing was changed on this host.")


def test_fresh_rig_without_driver_counts_gpus_on_the_pci_bus():
    state = converge(
        {"fresh": rig(gpus=[], extra={"/sys/bus/pci/devices": ["pci 0000:01:00.0 0x2204", "end"]}), "ok": rig(gpus=[])},
        site(),
    )
    assert {h.name for h in state.failed_hosts} == {"@fake/fresh"}
    assert "touch /rigforge-was-here" not in executed(state, "fresh")


def test_all_hosts_bad_stops_the_run():
    with pytest.raises(PyinfraError, match="No hosts remaining"):
        converge({"old": rig(os="debian11")}, site())


def _problems(os="ubuntu2404", gpus=None, free=500e9, data=None, pci=None, **variant):
    gpus = (
        [
            dict(index=i, name="RTX 3090", memory_total=24576, power_min_limit=100.0, power_max_limit=350.0)
            for i in range(2)
        ]
        if gpus is None
        else gpus
    )
    release = dict(
        zip(
            ("id", "version_id"),
            {
                "ubuntu2204": ("ubuntu", "22.04"),
                "ubuntu2404": ("ubuntu", "24.04"),
                "debian12": ("debian", "12"),
                "debian13": ("debian", "13"),
                "debian11": ("debian", "11"),
            }[os],
            strict=True,
        )
    )
    base = {"gpu_power_limit_w": 230, "gpu_power_limits": {}, "docker_source": "docker", "nvidia_driver_flavor": "open"}
    needs = replace(PREFLIGHT, **variant)
    knobs, settings = checked({**base, **(data or {})})
    return hardware.find_problems(release, gpus, free, pci=pci, needs=needs, knobs=knobs, settings=settings)


def card20(i):
    return dict(index=i, name="RTX 4000 Ada", memory_total=20475, power_min_limit=70.0, power_max_limit=130.0)


def test_problem_matrix():
    assert _problems() == []
    for os in ("ubuntu2204", "ubuntu2404", "debian12", "debian13"):
        assert _problems(os) == [], os
    (old,) = _problems("debian11")
    assert "unsupported OS debian 11" in old and "Ubuntu 22.04" in old
    (disk,) = _problems(free=12e9)
    assert "free disk at /opt/rigforge/models is 12.0 GB" in disk and "needs 25.0 GB" in disk
    (small,) = _problems(gpus=[card20(0), card20(1)], data={"gpu_power_limit_w": 120})
    assert "serving_kv_cache_dtype: fp8_e5m2" in small and "serving_gpu_memory_utilization: 0.82" in small
    override = {"gpu_power_limit_w": 120, "serving_kv_cache_dtype": "fp8_e5m2", "serving_gpu_memory_utilization": 0.82}
    assert _problems(gpus=[card20(0), card20(1)], data=override) == []
    dflash = _problems(gpus=[card20(0), card20(1)], data=override, dflash=True, variant="dual-dflash")
    assert len(dflash) == 1 and "GPU 0, 1 (RTX 4000 Ada) have 20475 MiB" in dflash[0] and "DFlash" in dflash[0]
    (both,) = _problems(data={"gpu_power_limit_w": 90})
    assert "outside GPU 0, 1 (RTX 3090) range 100..350 W" in both
    (bookworm,) = _problems("debian12", data={"docker_source": "distro"})
    assert "Debian 12" in bookworm and "docker_source: docker" in bookworm
    (override_idx,) = _problems(data={"gpu_power_limits": {5: 200}})
    assert "gpu_power_limits names GPU(s) [5]" in override_idx
    (per_gpu,) = _problems(data={"gpu_power_limits": {"1": 380}})
    assert "GPU 1" in per_gpu and "gpu_power_limits" in per_gpu and "100..350" in per_gpu
    (words,) = _problems(data={"gpu_power_limit_w": "lots"})
    assert "whole watts" in words
    assert _problems(gpus=[]) == []  # no driver yet: GPU checks wait for the GPUs to be visible
    (pci,) = _problems(gpus=[], pci=[("0000:01:00.0", "2204")])
    assert "the PCI bus shows 1 NVIDIA GPU(s)" in pci
    assert _problems(gpus=[], pci=[("0000:01:00.0", "2204"), ("0000:02:00.0", "2204")]) == []


def test_a_fresh_rigs_cards_are_known_by_their_pci_device_id_before_any_driver():
    """10de:2204 is an RTX 3090 (24 GB): fine. 10de:2503 is an RTX 3060 (12 GB, no larger build): refused before
    the driver. 10de:2206 is an RTX 3080, 10 GB stock but also sold modded with 20 GB under the same ID: only the
    driver can tell, so with the 20 GB override it waits for the driver; DFlash (24 GB only) is refused at once.
    An ID not in the table waits for the driver too."""
    two = lambda device: [("0000:01:00.0", device), ("0000:02:00.0", device)]  # noqa: E731
    override = {"serving_kv_cache_dtype": "fp8_e5m2", "serving_gpu_memory_utilization": 0.82}
    assert _problems(gpus=[], pci=two("2204")) == []
    (small,) = _problems(gpus=[], pci=two("2503"))
    assert small.startswith("by PCI device ID (largest known build of the card; before any driver): GPU 0000:01:00.0")
    assert "GeForce RTX 3060, PCI ID 10de:2503) have 12288 MiB; every variant needs 24 GB cards" in small
    assert _problems(gpus=[], pci=two("2503"), data=override) == [small]  # no override makes 12 GB enough
    assert _problems(gpus=[], pci=two("2206"), data=override) == []  # maybe a 20 GB 3080: the driver will tell
    (no_override,) = _problems(gpus=[], pci=two("2206"))
    assert "for 20 GB cards set serving_kv_cache_dtype: fp8_e5m2" in no_override
    (dflash,) = _problems(gpus=[], pci=two("2206"), data=override, dflash=True)
    assert "(DFlash) needs 24 GB cards" in dflash
    assert _problems(gpus=[], pci=two("1b06")) == []  # unknown ID: the driver's answer decides


def test_the_plan_refuses_a_bad_role_switch_before_preflight():
    """docker_source, nvidia_allow_reboot and nvidia_driver_flavor: refused with the plan (their roles' knob checks),
    so preflight never sees a bad one."""
    plan_problems = lambda **data: fleet.plan_for("r", {"rigforge_variant": "dual-turbo", **data}, deployable=False)  # noqa: E731
    (plan, (bad_source,)) = plan_problems(docker_source="snap")
    assert plan is None and "docker_source='snap'" in bad_source and "docker, distro" in bad_source
    (plan, (reboot,)) = plan_problems(nvidia_allow_reboot="yes")
    assert plan is None and "nvidia_allow_reboot='yes' must be true or false" in reboot
    (plan, (flavor,)) = plan_problems(nvidia_driver_flavor="closed")
    assert plan is None and "open, proprietary" in flavor


def test_message_names_host_and_every_problem():
    message = hardware.format_problems("rig7", ["a", "b"])
    assert message.splitlines() == ["preflight failed on rig7:", "  - a", "  - b", "Nothing was changed on this host."]


# --- nvidia_driver -------------------------------------------------------------------------------------


def test_driver_sources_file_is_deb822_flat_with_signed_by():
    text = apt_repo.deb822_source(
        "https://example/cuda/ubuntu2404/x86_64/", "/", "/etc/apt/keyrings/rigforge-nvidia-cuda.asc"
    )
    assert text.splitlines() == [
        "Types: deb",
        "URIs: https://example/cuda/ubuntu2404/x86_64/",
        "Suites: /",
        "Signed-By: /etc/apt/keyrings/rigforge-nvidia-cuda.asc",
    ]
    docker = apt_repo.deb822_source("https://download.docker.com/linux/ubuntu", "noble", "/k.asc", "stable", "amd64")
    assert "Components: stable" in docker and "Architectures: amd64" in docker and "Suites: noble" in docker


@pytest.mark.parametrize("os,codename", [("ubuntu2204", "jammy"), ("ubuntu2404", "noble")])
def test_ubuntu_sources_files(os, codename):
    state = converge({"u": rig(os)}, planned(docker_engine.install), execute=False)
    files = uploads(state, "u")
    assert files["/etc/apt/sources.list.d/rigforge-docker.sources"].splitlines()[1:] == [
        "Types: deb",
        "URIs: https://download.docker.com/linux/ubuntu",
        f"Suites: {codename}",
        "Components: stable",
        "Architectures: amd64",
        "Signed-By: /etc/apt/keyrings/rigforge-docker.asc",
    ]
    toolkit = files["/etc/apt/sources.list.d/rigforge-nvidia-container-toolkit.sources"]
    assert "URIs: https://nvidia.github.io/libnvidia-container/stable/deb/amd64/" in toolkit and "Suites: /" in toolkit
    daemon = json.loads(files["/etc/docker/.daemon.json.rigforge-new"])
    assert daemon == {"runtimes": {"nvidia": {"args": [], "path": "nvidia-container-runtime"}}}
    state = converge({"u": rig(os)}, planned(nvidia_driver.install), execute=False)
    cuda = uploads(state, "u")["/etc/apt/sources.list.d/rigforge-nvidia-cuda.sources"]
    assert f"URIs: https://developer.download.nvidia.com/compute/cuda/repos/{os}/x86_64/" in cuda
    assert "Signed-By: /etc/apt/keyrings/rigforge-nvidia-cuda.asc" in cuda and "Suites: /" in cuda
    state = converge({"u": rig(os)}, gpu_power.apply, power_plan(), execute=False)
    staged = uploads(state, "u")["/etc/systemd/system/.staging/rigforge-gpu-power.service"]  # verified, then moved
    assert staged == render_power_unit({0: 230, 1: 230}).encode()


def test_reboot_decisions():
    ok = {"installed": True, "ok": True, "message": ""}
    broken = {"installed": True, "ok": False, "message": "couldn't communicate with the NVIDIA driver"}
    assert nvidia.reboot_reason(None, None, broken) is None  # nothing installed yet
    assert nvidia.reboot_reason("580.95.05-1", "580.95.05", ok) is None
    assert "mismatch" in nvidia.reboot_reason("580.95.05-1", "575.57.08", broken)
    assert "not loaded" in nvidia.reboot_reason("580.95.05-1", None, broken)
    assert nvidia.reboot_reason("580.95.05-1", None, ok) is None  # testbed: stub driver works, no module


def test_reboot_needed_without_permission_stops_the_host_with_a_message():
    r = rig(
        gpus=[],
        extra={
            "dpkg-query": "installed 580.95.05-1",
            "/sys/module/nvidia/version": "575.57.08",
            "nvidia-smi -L": ["rc=18", "Failed to initialize NVML: Driver/library version mismatch"],
        },
    )
    state = converge({"r": r}, planned(nvidia_driver.install), execute=False)
    (cmd,) = op_commands(state, "r", nvidia.reboot_if_needed, package="nvidia-driver-580-open", allow_reboot=False)
    assert cmd.startswith("FAIL: reboot needed on @fake/r: Driver/library version mismatch")
    assert "nvidia_allow_reboot: true" in cmd
    allowed = op_commands(state, "r", nvidia.reboot_if_needed, package="nvidia-driver-580-open", allow_reboot=True)
    assert any("reboot" in c for c in allowed) and not any(c.startswith("FAIL") for c in allowed)
    assert allowed[-1] == "call retake"  # back up: the run takes the rig's lock again (roles/rig_lock.py)


def test_never_reboots_the_controller():
    inventory = Inventory((["@local"], {}))
    state = State(inventory, Config())
    with ctx_state.use(state), ctx_host.use(inventory.get_host("@local")):
        assert nvidia.on_controller()
    fake = make_state({"r": rig(ssh_hostname="127.0.0.1")})
    with ctx_state.use(fake), ctx_host.use(host_of(fake, "r")):
        assert nvidia.on_controller() is False  # not an SSH connection: ssh_hostname is not its address
    ssh = [("loop", {"ssh_hostname": "127.0.0.1"}), ("lan", {"ssh_hostname": "192.0.2.7"}), ("localhost", {})]
    inventory = Inventory((ssh, {}))
    state = State(inventory, Config())  # SSH hosts, never connected: the connector only holds its data
    for name, expected in (("loop", True), ("lan", False), ("localhost", True)):
        with ctx_state.use(state), ctx_host.use(inventory.get_host(name)):
            assert nvidia.on_controller() is expected, name


# --- docker_engine -------------------------------------------------------------------------------------


def test_docker_distro_on_ubuntu_and_debian13():
    assert packages.docker("distro", "ubuntu", "22.04").specs == ("docker.io", "docker-compose-v2")
    # Debian 13's docker.io only recommends docker-cli, which ships /usr/bin/docker
    assert packages.docker("distro", "debian", "13").specs == ("docker.io", "docker-cli", "docker-compose")
    state = converge({"u": rig("ubuntu2204", docker_source="distro")}, planned(docker_engine.install))
    commands = executed(state, "u")
    assert any(" install " in c and "docker.io" in c and "docker-compose-v2" in c for c in commands)
    assert not any("download.docker.com" in c for c in commands)
    assert any("https://nvidia.github.io/libnvidia-container/gpgkey" in c for c in commands)
    assert any(" install " in c and "nvidia-container-toolkit" in c for c in commands)
    assert not any("nvidia-ctk runtime" in c for c in commands)  # daemon.json is merged by rigforge, not by nvidia-ctk


@pytest.mark.parametrize("os,distro", [("ubuntu2404", "ubuntu"), ("debian12", "debian")])
def test_docker_from_dockers_repo_with_pins(os, distro):
    pins = {"docker-ce": "5:28.5.1-1~ubuntu.24.04~noble", "docker-ce-cli": "5:28.5.1-1~ubuntu.24.04~noble"}
    assert packages.docker("docker", distro, "", pins).specs == (
        "docker-ce=5:28.5.1-1~ubuntu.24.04~noble",
        "docker-ce-cli=5:28.5.1-1~ubuntu.24.04~noble",
        "containerd.io",
        "docker-buildx-plugin",
        "docker-compose-plugin",
    )
    state = converge({"d": rig(os, docker_package_versions=pins)}, planned(docker_engine.install))
    commands = executed(state, "d")
    assert any(f"https://download.docker.com/linux/{distro}/gpg" in c for c in commands)
    (install,) = [c for c in commands if " install " in c and "docker-ce" in c]
    assert "docker-ce=5:28.5.1-1~ubuntu.24.04~noble" in install and "docker-compose-plugin" in install


def test_daemon_json_merge_keeps_user_keys_and_is_stable():
    user = {"log-driver": "journald", "runtimes": {"runsc": {"path": "/usr/bin/runsc"}}}
    text = merged_text(json.dumps(user), NVIDIA_RUNTIME)
    merged = json.loads(text)
    assert merged["log-driver"] == "journald"
    assert merged["runtimes"] == {
        "runsc": {"path": "/usr/bin/runsc"},
        "nvidia": {"args": [], "path": "nvidia-container-runtime"},
    }
    assert merged_text(text, NVIDIA_RUNTIME) is None  # equal: no write
    # Same data, different formatting: still equal.
    assert merged_text(json.dumps(merged, separators=(",", ":")), NVIDIA_RUNTIME) is None
    assert json.loads(merged_text(None, NVIDIA_RUNTIME)) == NVIDIA_RUNTIME
    with pytest.raises(ValueError):
        merged_text("{not json", NVIDIA_RUNTIME)
    with pytest.raises(ValueError):
        merged_text("[1]", NVIDIA_RUNTIME)


def test_daemon_json_operation_writes_atomically_and_restarts_docker_only_on_change():
    existing = {"runtimes": {"nvidia": {"args": [], "path": "nvidia-container-runtime"}}, "data-root": "/srv/docker"}
    same = rig(
        rigforge_manage_services=True,
        extra={
            "daemon.json": json.dumps(existing, indent=2).splitlines(),
            "SubState": ["Id=docker.service", "SubState=running"],
        },
    )
    state = converge({"s": same}, planned(docker_engine.install))
    assert not any("restart" in c or "daemon.json" in c and "mv" in c for c in executed(state, "s"))
    fresh = rig(rigforge_manage_services=True, extra={"SubState": ["Id=docker.service", "SubState=running"]})
    state = converge({"f": fresh}, planned(docker_engine.install))
    commands = executed(state, "f")
    (move,) = [c for c in commands if "mv -f" in c and "daemon.json" in c]
    assert "/etc/docker/.daemon.json.rigforge-new" in move and move.rstrip().endswith("/etc/docker/daemon.json")
    assert any("systemctl restart docker.service" in c for c in commands)
    offline = converge({"o": rig(rigforge_manage_services=False)}, planned(docker_engine.install))
    assert not any("systemctl" in c and "docker" in c for c in executed(offline, "o"))


def test_broken_daemon_json_stops_the_host_unchanged():
    state = converge({"b": rig(extra={"daemon.json": "{broken"}), "ok": rig()}, planned(docker_engine.install))
    assert {h.name for h in state.failed_hosts} == {"@fake/b"}
    assert not any(".rigforge-new" in c for c in executed(state, "b"))


# --- gpu_power ---------------------------------------------------------------------------------------


def test_caps_applied_only_where_they_differ():
    state = converge(
        {"r": rig(gpus=[gpu_row(0, limit=230.0), gpu_row(1, limit=350.0, pm="Disabled")])},
        gpu_power.apply,
        power_plan(),
    )
    commands = executed(state, "r")
    assert [c for c in commands if "-pl" in c] == ["nvidia-smi -i 1 -pl 230"]
    assert [c for c in commands if "-pm" in c] == ["nvidia-smi -i 1 -pm 1"]
    assert any("systemctl enable rigforge-gpu-power.service" in c for c in commands)
    assert any("systemctl daemon-reload" in c for c in commands)


def test_caps_no_op_when_set_and_per_gpu_overrides():
    state = converge(
        {"r": rig(gpus=[gpu_row(0, limit=230.0), gpu_row(1, limit=250.0)])},
        gpu_power.apply,
        power_plan(),
        execute=False,
    )
    assert op_commands(state, "r", nvidia.power_caps, default_w=230, overrides={1: 250}) == []
    assert op_commands(state, "r", nvidia.power_caps, default_w=230, overrides={"1": 260}) == [
        "SAY: GPU1 at 250 W, declared 260 W: setting the declared caps",  # what differs (rigforge.observe.verdict.caps)
        "nvidia-smi -i 1 -pl 260",
    ]
    assert op_commands(state, "r", nvidia.persistence_mode) == []
    enabled = rig(extra={"is-enabled": "enabled"})
    state = converge({"e": enabled}, gpu_power.apply, power_plan(), execute=False)
    from roles.operations import systemd_units

    assert op_commands(state, "e", systemd_units.enabled, unit="rigforge-gpu-power.service") == []


def test_the_cap_hold_is_installed_and_enabled_or_stopped_when_turned_off():
    """gpu_power_hold (default true): the hold's script, unit and timer installed, the timer enabled; false: the
    files stay (the settle stage runs the pass), the timer is stopped and disabled once, when it is enabled."""
    commands = executed(converge({"r": rig()}, gpu_power.apply, power_plan()), "r")
    assert any("systemctl enable rigforge-gpu-hold.timer" in c for c in commands)
    assert any("rigforge-gpu-hold.timer" in c and "rigforge-gpu-hold.service" in c for c in commands)  # installed
    off = make_plan(settings=Settings(), gpu_power_hold=False)
    commands = executed(converge({"r": rig(extra={"is-enabled": "enabled"})}, gpu_power.apply, off), "r")
    assert "systemctl disable --now rigforge-gpu-hold.timer" in "\n".join(commands)
    assert not any("systemctl enable rigforge-gpu-hold.timer" in c for c in commands)
    commands = executed(converge({"r": rig()}, gpu_power.apply, off), "r")  # not enabled: nothing to stop
    assert not any("disable" in c or "enable rigforge-gpu-hold" in c for c in commands)


@pytest.mark.parametrize("cap", [90, 400])
def test_cap_outside_range_refused_in_gpu_power_too(cap):
    state = make_state({"r": rig(gpus=[gpu_row(0), gpu_row(1, max_w=390.0)])})
    add_deploy(state, gpu_power.apply, power_plan(cap))
    state.set_stage(StateStage.Execute)
    with pytest.raises(PyinfraError, match="No hosts remaining"):
        run_ops(state)
    assert {h.name for h in state.failed_hosts} == {"@fake/r"}
    assert not any("-pl" in c for c in executed(state, "r"))
    two = {"r": rig(gpus=[gpu_row(0), gpu_row(1, max_w=390.0)])}
    state = converge(two, gpu_power.apply, power_plan(), execute=False)
    (fail,) = op_commands(state, "r", nvidia.power_caps, default_w=cap)
    assert f"power cap {cap} W" in fail and "range 100..350 W" in fail
    if cap == 400:
        assert "GPU 1" in fail and "range 100..390 W" in fail


def test_an_unpublished_driver_branch_names_the_published_ones():
    from rigforge.model.driver_table import DriverPackages
    from roles.preflight import unpublished

    packages = DriverPackages("nvidia-driver-pinning-595", ("nvidia-open",), "nvidia-open")
    published = ["cuda-drivers", "nvidia-driver-pinning-580", "nvidia-driver-pinning-590", "nvidia-open"]
    branch595 = NvidiaDriver.of({"nvidia_driver_branch": 595})
    line = unpublished(branch595, "https://x/repos/debian13/x86_64/", packages, published)
    assert line == (
        "nvidia_driver_branch 595: NVIDIA's repository https://x/repos/debian13/x86_64/ does not publish "
        "nvidia-driver-pinning-595; it publishes driver branches 580, 590: set nvidia_driver_branch to a published "
        "branch (nothing was installed)."
    )
    branch580 = NvidiaDriver.of({"nvidia_driver_branch": 580})
    assert unpublished(branch580, "u", packages, [*published, "nvidia-driver-pinning-595"]) is None


# --- monitor (rigs) ----------------------------------------------------------------------------------


def test_monitor_installs_node_exporter_the_collector_and_its_timer():
    from rigforge.model.render import gpu_metrics_units, render_gpu_metrics
    from roles import monitor

    plan = power_plan()
    state = converge({"r": rig()}, monitor.rig, plan)
    commands = executed(state, "r")
    assert any("apt-get" in c and "install" in c and "prometheus-node-exporter" in c for c in commands)
    assert any("systemctl enable rigforge-gpu-metrics.timer" in c for c in commands)
    assert any("systemctl daemon-reload" in c for c in commands)
    files = uploads(state, "r")
    staged = files["/usr/local/lib/rigforge/.staging/rigforge-gpu-metrics"]  # validated by sh -n, then moved
    assert staged == render_gpu_metrics(plan.caps, plan.variant.name, plan.image).encode()
    for name, text in gpu_metrics_units(plan.layout).items():
        assert files[f"/etc/systemd/system/.staging/{name}"] == text.encode()


def test_the_monitor_host_gets_prometheus_the_fleets_config_and_rules_checked_by_promtool():
    from rigforge.model import monitor as monitor_config
    from rigforge.model.fleet import host_data
    from rigforge.model.knobs.monitor import Monitor
    from roles import monitor

    targets = {"node": (("rig1", "rig1:9100"),), "vllm": (("rig1", "rig1:8010"),), "haproxy": (("gw", "gw:8405"),)}
    knobs = Monitor.of(host_data({"monitor_retention_time": "30d"}))
    state = converge({"m": rig()}, monitor.server, targets, knobs, False)
    commands = executed(state, "m")
    assert any("apt-get" in c and "install" in c and "prometheus" in c for c in commands)
    assert any(
        "promtool check rules rigforge-alerts.rules.yml && promtool check config prometheus.yml" in c for c in commands
    )
    files = uploads(state, "m")
    assert files["/etc/prometheus/.staging/prometheus.yml"] == monitor_config.render_config(targets, knobs).encode()
    assert files["/etc/prometheus/.staging/rigforge-alerts.rules.yml"] == monitor_config.rules().encode()
    assert "--storage.tsdb.retention.time=30d --storage.tsdb.retention.size=10GB" in files["/etc/default/prometheus"]
