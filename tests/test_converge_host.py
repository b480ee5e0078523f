"""Tier 4: the host roles converge a testbed rig over real SSH as a sudo user (simulated GPUs, no systemd).

A fresh rig converges; a second run changes nothing; testinfra then checks what a rig owner relies on.
Bad input (a fresh 1-GPU rig, caps of 90 W / 400 W on 100..350 W cards) stops before any change to the rig.
Services are installed and enabled, not started: no systemd runs in the chroot (rigforge_manage_services=False).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import support

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "tests" / "deploys" / "host_roles.py"
PYINFRA = str(Path(sys.executable).with_name("pyinfra"))

pytestmark = pytest.mark.testbed


def pyinfra_run(inventory: Path, *extra: str) -> tuple[dict, str]:
    """`pyinfra -y --json INVENTORY tests/deploys/host_roles.py`; returns (results JSON, stderr)."""
    return support.pyinfra_run(inventory, DEPLOY, *extra)


changed_ops = support.changed
TOOLKIT = [
    "libnvidia-container-tools",
    "libnvidia-container1",
    "nvidia-container-toolkit",
    "nvidia-container-toolkit-base",
]


def rig_snapshot(rig) -> str:
    """Everything the host roles could touch, as text (paths + checksums + package states + GPU caps)."""
    script = (
        "find /etc/apt /etc/docker /etc/modprobe.d /etc/systemd/system -xdev -printf '%p %s %m\\n' 2>/dev/null | sort;"
        "dpkg-query -W -f '${Package} ${db:Status-Abbrev}\\n' | sort; apt-mark showhold;"
        "nvidia-smi --query-gpu=index,power.limit,persistence_mode --format=csv,noheader 2>&1 || true"
    )
    return rig.run(script).stdout


@pytest.fixture(scope="module")
def converged(testbed_factory):
    from rigforge.testbed import RigSpec

    tb = testbed_factory([RigSpec()], name="hostroles")
    first, first_err = pyinfra_run(tb.inventory)
    assert first.get("failed_hosts") == [], first_err[-6000:]
    second, second_err = pyinfra_run(tb.inventory)
    return tb, first, second, second_err


def test_fresh_rig_converges(converged):
    tb, first, _, _ = converged
    assert first["totals"]["error"] == 0
    names = changed_ops(first)
    assert any("Install NVIDIA 580 driver packages" in n for n in names)
    assert any("nvidia runtime" in n for n in names)


def test_second_run_changes_nothing(converged):
    _, _, second, err = converged
    assert second.get("failed_hosts") == [], err[-4000:]
    assert second["totals"]["error"] == 0
    assert changed_ops(second) == [], f"second run changed: {changed_ops(second)}"
    assert second["totals"]["no_change"] > 20


def test_rig_state_with_testinfra(converged):
    tb = converged[0]
    h = tb.testinfra_host("rig1")
    key = h.file("/etc/apt/keyrings/rigforge-nvidia-cuda.asc")
    assert (
        key.exists and key.user == "root" and key.mode == 0o644 and "BEGIN PGP PUBLIC KEY BLOCK" in key.content_string
    )
    sources = h.file("/etc/apt/sources.list.d/rigforge-nvidia-cuda.sources").content_string
    assert "Suites: /" in sources and "Signed-By: /etc/apt/keyrings/rigforge-nvidia-cuda.asc" in sources
    assert f"URIs: {tb.driver_repo_url}" in sources
    toolkit = h.file("/etc/apt/sources.list.d/rigforge-nvidia-container-toolkit.sources").content_string
    assert "Signed-By: /etc/apt/keyrings/rigforge-nvidia-container-toolkit.asc" in toolkit
    assert not h.file("/etc/apt/trusted.gpg").exists  # no apt-key
    # NVIDIA's Debian naming, the branch locked by its pinning package although the repo also has 590
    assert h.package("nvidia-open").is_installed and h.package("nvidia-open").version == "580.159.04-1"
    assert h.package("nvidia-kernel-open-dkms").version == "580.159.04-1"
    assert not h.package("nvidia-driver-580-open").is_installed
    held = h.check_output("apt-mark showhold").split()
    driver = ["nvidia-driver-cuda", "nvidia-driver-pinning-580", "nvidia-kernel-open-dkms", "nvidia-open"]
    assert sorted(held) == sorted([*driver, *TOOLKIT])
    assert "Candidate: 580.159.04-1" in h.check_output("apt-cache policy nvidia-open")
    # the lock's toolkit pin (NVIDIA/nvidia-container-toolkit#1967): 1.19.0-1 and held, although the repo has 1.19.1-1
    assert "1.19.1-1" in h.check_output("apt-cache madison nvidia-container-toolkit")
    query = "dpkg-query -W -f '${db:Status-Abbrev} ${Package} ${Version}\\n' " + " ".join(TOOLKIT)
    assert sorted(line.split() for line in h.check_output(query).splitlines()) == [
        ["hi", name, "1.19.0-1"] for name in TOOLKIT
    ]
    assert h.package("docker.io").is_installed
    daemon = json.loads(h.file("/etc/docker/daemon.json").content_string)
    assert daemon["runtimes"]["nvidia"] == {"args": [], "path": "nvidia-container-runtime"}
    assert "blacklist nouveau" in h.file("/etc/modprobe.d/rigforge-blacklist-nouveau.conf").content_string
    unattended = h.file("/etc/apt/apt.conf.d/51rigforge-nvidia-unattended-upgrades").content_string
    assert '"^nvidia-";' in unattended and '"^nvidia-kernel-open-dkms$";' in unattended
    caps = h.check_output("nvidia-smi --query-gpu=index,power.limit,persistence_mode --format=csv,noheader,nounits")
    assert [line.split(", ") for line in caps.splitlines()] == [["0", "230.00", "Enabled"], ["1", "230.00", "Enabled"]]
    unit = h.file("/etc/systemd/system/rigforge-gpu-power.service")
    assert unit.mode == 0o644 and "-i 1 -pl 230" in unit.content_string
    assert h.check_output("systemctl is-enabled rigforge-gpu-power.service") == "enabled"


def test_user_daemon_json_keys_survive(converged):
    """A user rewrote daemon.json without the nvidia runtime: it comes back, the user's keys stay."""
    tb = converged[0]
    path = tb.rig("rig1").rootfs / "etc/docker/daemon.json"
    path.write_text(json.dumps({"log-driver": "journald", "runtimes": {"runsc": {"path": "/usr/bin/runsc"}}}))
    results, err = pyinfra_run(tb.inventory)
    assert changed_ops(results) == [
        "Docker engine and NVIDIA Container Toolkit | Add the nvidia runtime to /etc/docker/daemon.json"
    ], err[-1500:]
    merged = json.loads(path.read_text())
    assert merged["log-driver"] == "journald"
    assert sorted(merged["runtimes"]) == ["nvidia", "runsc"]
    again, _ = pyinfra_run(tb.inventory)
    assert changed_ops(again) == []


def toolkit_state(rig) -> list[list[str]]:
    query = "dpkg-query -W -f '${db:Status-Abbrev} ${Package} ${Version}\\n' " + " ".join(TOOLKIT)
    return sorted(line.split() for line in rig.run(query).stdout.splitlines())


def test_host_data_moves_the_held_toolkit_and_the_lock_brings_it_back(converged):
    """nvidia_toolkit_version overrides the lock's pin on a rig where rigforge already held the toolkit (apt drops
    the hold when it replaces the packages, rigforge holds the new ones); without it the next run goes back to the
    lock's 1.19.0-1, held, and the run after changes nothing."""
    tb = converged[0]
    rig = tb.rig("rig1")
    role = "Docker engine and NVIDIA Container Toolkit"
    for data, version in ((["--data", "nvidia_toolkit_version=1.19.1-1"], "1.19.1-1"), ([], "1.19.0-1")):
        results, err = pyinfra_run(tb.inventory, *data)
        assert changed_ops(results) == [
            f"{role} | Install the NVIDIA Container Toolkit {version}",
            f"{role} | Hold the NVIDIA Container Toolkit packages",
        ], err[-3000:]
        assert toolkit_state(rig) == [["hi", name, version] for name in TOOLKIT]
    again, _ = pyinfra_run(tb.inventory)
    assert changed_ops(again) == []


def assert_stopped_in_preflight(tb, data: list[str], expect: str, header: str = "preflight failed on rig1"):
    rig = tb.rig("rig1")
    before = rig_snapshot(rig)
    results, err = pyinfra_run(tb.inventory, *data)
    assert results["failed_hosts"] == "all", err[-4000:]  # the only host failed: pyinfra stops
    assert changed_ops(results) == []
    assert header in err and expect in err, err[-4000:]
    assert rig_snapshot(rig) == before


def test_cap_outside_card_range_stops_in_preflight_with_nothing_changed(converged):
    assert_stopped_in_preflight(
        converged[0],
        ["--data", "gpu_power_limit_w=400"],
        "power cap 400 W (gpu_power_limit_w) is outside GPU 0, 1 (NVIDIA GeForce RTX 3090) range 100..350 W",
    )


def test_cap_outside_any_card_range_is_refused_with_the_host_data(converged):
    assert_stopped_in_preflight(
        converged[0],
        ["--data", "gpu_power_limit_w=90"],
        "gpu_power_limit_w must be whole watts in 100..600, got 90",
        header="rigforge refused on rig1",
    )


def test_one_gpu_rig_stops_in_preflight_with_nothing_changed(testbed_factory):
    """A fresh rig (no driver yet): preflight counts the GPUs on the (simulated) PCI bus."""
    from rigforge.testbed import RigSpec

    tb = testbed_factory([RigSpec(gpus=1)], name="hostroles-1gpu")
    assert_stopped_in_preflight(tb, [], "variant dual-turbo needs 2 GPUs, the PCI bus shows 1 NVIDIA GPU(s)")


def test_dry_run_reports_bad_input_and_changes_nothing(converged):
    tb = converged[0]
    rig = tb.rig("rig1")
    before = rig_snapshot(rig)
    cmd = [PYINFRA, "--dry", str(tb.inventory), str(DEPLOY), "--data", "gpu_power_limit_w=400"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr[-4000:]  # the pre-flight of a refused host fails
    assert "preflight failed on rig1" in proc.stderr and "power cap 400 W" in proc.stderr, proc.stderr[-4000:]
    table = proc.stderr.split("Detected changes:")[-1].split("\n\n")[0].splitlines()[2:]  # under the header
    assert table and all("refused" in line for line in table), table  # nothing listed after the refusal
    assert rig_snapshot(rig) == before


@pytest.mark.parametrize("allow", ["false", "true"])
def test_driver_library_mismatch_stops_with_reboot_needed(converged, allow):
    """A loaded kernel module older than the installed driver: reboot needed. The rig is a chroot on the
    controller (SSH to 127.0.0.1), so even with nvidia_allow_reboot it is never rebooted, only stopped."""
    tb = converged[0]
    rig = tb.rig("rig1")
    module = rig.rootfs / "sys/module/nvidia/version"
    module.parent.mkdir(parents=True, exist_ok=True)
    module.write_text("575.57.08\n")
    try:
        results, err = pyinfra_run(tb.inventory, "--data", f"nvidia_allow_reboot={allow}")
    finally:
        module.unlink()
    assert results["failed_hosts"] == "all", err[-3000:]
    assert "reboot needed on rig1: Driver/library version mismatch: loaded kernel module 575.57.08" in err
    expected = "never reboots the machine it runs on" if allow == "true" else "set nvidia_allow_reboot: true"
    assert expected in err
    again, _ = pyinfra_run(tb.inventory)
    assert changed_ops(again) == []


def test_fleet_one_rig_refused_the_other_converges(testbed_factory):
    """Two fresh rigs in one run; rig2 asks for more disk than it has. pyinfra drops rig2 at preflight, before
    any of its operations changed it, and converges rig1 in the same run."""
    from rigforge.testbed import RigSpec
    from rigforge.testbed.core import host_data

    tb = testbed_factory([RigSpec(), RigSpec()], name="hostroles-fleet")
    rigs = [(rig.name, {**host_data(tb, rig)}) for rig in tb.rigs]
    rigs[1][1]["test_disk_needed_bytes"] = 10**16
    inventory = tb.dir / "inventory_mixed.py"
    inventory.write_text(f"rigs = {rigs!r}\n")
    before = rig_snapshot(tb.rig("rig2"))
    results, err = pyinfra_run(inventory)
    assert results["failed_hosts"] == ["rig2"], err[-3000:]
    assert "preflight failed on rig2" in err and "free disk at /opt/rigforge/models" in err
    changed = [op for op in results["operations"] if op["success"]]
    assert changed and all(op["success"] == ["rig1"] for op in changed)
    assert rig_snapshot(tb.rig("rig2")) == before
    assert "230.00" in tb.rig("rig1").run("nvidia-smi --query-gpu=power.limit --format=csv,noheader").stdout


def test_roles_also_work_as_root_through_chroot(testbed_factory):
    """The same roles as root (no sudo): pyinfra's @chroot connector on a fresh rig's root file system."""
    from rigforge.testbed import RigSpec
    from rigforge.testbed.core import host_data

    tb = testbed_factory([RigSpec()], name="hostroles-root")
    rig = tb.rig("rig1")
    data = {k: v for k, v in host_data(tb, rig).items() if not k.startswith(("ssh_", "_sudo"))}
    inventory = tb.dir / "inventory_chroot.py"
    inventory.write_text(f"rigs = [({'@chroot/' + str(rig.rootfs)!r}, {data!r})]\n")
    first, err = pyinfra_run(inventory)
    assert first["failed_hosts"] == [] and changed_ops(first), err[-3000:]
    second, err = pyinfra_run(inventory)
    assert changed_ops(second) == [], err[-3000:]
    assert "nvidia-open" in rig.run("apt-mark showhold").stdout.split()
