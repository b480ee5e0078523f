"""Booted: rigforge's caps are the last ones written at boot, whatever else on the rig sets caps (issue 29).

On ONE booted rig, four kinds of competing writers are installed at once, each setting 250 W and appending
"NAME ran <boot id>" to /var/log/cap-writers.log: the recipe repo's own nvidia-power-cap.service (with a drop-in
that logs), a home-made unit After=multi-user.target + WantedBy=multi-user.target (which made an ordering cycle
with rigforge's old After= ordering), a unit whose ExecStart runs a script calling `nvidia-smi -pl`, and a
`@reboot` cron job (cron installed in the rig from Debian's mirror, late: it sleeps a few seconds first). Then
dual is deployed and the rig rebooted with `rigforge testbed reboot`: every writer ran at this boot, both cards
read 230 W once the settle stage finished, the vLLM unit is active, `journalctl -b` has no ordering cycle,
`rigforge verify` passes "caps set last at this boot", `rigforge status` says so, and a re-run changes nothing.

Marked `booted` and `testbed`; skipped with the reason when this machine cannot boot rigs.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import changed, errored, inventory_with, pyinfra_run

pytestmark = [pytest.mark.testbed, pytest.mark.booted]
REPO = Path(__file__).resolve().parents[2]
DUAL, DUAL_PORT = "rigforge-vllm@dual.service", 8010
LOG = "/var/log/cap-writers.log"
WRITERS = ("nvidia-power-cap.service", "homemade-cap.service", "gpu-setup.service", "cron @reboot")
CAP_LOG = f"""#!/bin/sh
# cap-log NAME: a competing writer says it ran at this boot
echo "$1 ran $(cat /proc/sys/kernel/random/boot_id)" >> {LOG}
"""
HOMEMADE = """[Unit]
Description=home-made GPU cap (After=multi-user.target: a common way to write one)
After=multi-user.target

[Service]
Type=oneshot
ExecStart=/usr/bin/nvidia-smi -pl 250
ExecStartPost=/usr/local/bin/cap-log homemade-cap.service

[Install]
WantedBy=multi-user.target
"""
GPU_SETUP_UNIT = """[Unit]
Description=GPU setup script

[Service]
Type=oneshot
ExecStart=/usr/local/bin/gpu-setup.sh

[Install]
WantedBy=multi-user.target
"""
GPU_SETUP = """#!/bin/sh
nvidia-smi -pm 1
nvidia-smi -i 0 -pl 250
nvidia-smi -i 1 -pl 250
/usr/local/bin/cap-log gpu-setup.service
"""
CRON_CAP = """#!/bin/sh
sleep 8
nvidia-smi -i 0 -pl 250
nvidia-smi -i 1 -pl 250
/usr/local/bin/cap-log 'cron @reboot'
"""
RECIPE_DROPIN = "[Service]\nExecStartPost=/usr/local/bin/cap-log nvidia-power-cap.service\n"


@pytest.fixture(scope="module")
def booted(testbed_factory):
    missing = [tool for tool in ("systemd-nspawn", "nsenter", "ip") if not shutil.which(tool)]
    if missing:
        pytest.skip(f"cannot boot rigs: {', '.join(missing)} not found (apt-get install systemd-container iproute2)")
    tb = testbed_factory(name="boot-order", booted=True)
    yield tb
    testbed_factory.release(tb)


def sh(rig, cmd: str, timeout_ok: bool = False) -> str:
    res = rig.run(cmd)
    assert res.returncode == 0, f"{cmd}: rc={res.returncode}\n{res.stdout}{res.stderr}"
    return res.stdout.strip()


def write(rig, path: str, text: str, mode: int = 0o644) -> None:
    dest = rig.rootfs / path.lstrip("/")
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(text)
    dest.chmod(mode)


def install_writers(rig) -> None:
    """The four competing writers, enabled, plus cron (from Debian's mirror: the rig reaches it)."""
    res = rig.run(
        "DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends cron 2>&1 || "
        "{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "
        "--no-install-recommends cron 2>&1; }"
    )
    assert res.returncode == 0, f"cron could not be installed in the rig: {res.stdout}{res.stderr}"
    write(rig, "/usr/local/bin/cap-log", CAP_LOG, 0o755)
    recipe = REPO / "tests/fixtures/club-3090-4a29ab57/scripts/systemd/nvidia-power-cap.service"
    write(rig, "/etc/systemd/system/nvidia-power-cap.service", recipe.read_text())
    write(rig, "/etc/systemd/system/nvidia-power-cap.service.d/log.conf", RECIPE_DROPIN)
    write(rig, "/etc/systemd/system/homemade-cap.service", HOMEMADE)
    write(rig, "/etc/systemd/system/gpu-setup.service", GPU_SETUP_UNIT)
    write(rig, "/usr/local/bin/gpu-setup.sh", GPU_SETUP, 0o755)
    write(rig, "/usr/local/bin/cron-cap.sh", CRON_CAP, 0o755)
    write(rig, "/etc/cron.d/gpu-cap", "@reboot root /usr/local/bin/cron-cap.sh\n")
    units = "nvidia-power-cap.service homemade-cap.service gpu-setup.service cron.service"
    sh(rig, f"systemctl daemon-reload && systemctl enable {units} 2>&1")


def caps(rig) -> list[str]:
    return sh(rig, "nvidia-smi --query-gpu=power.limit --format=csv,noheader,nounits").splitlines()


def inventory(booted) -> Path:
    """The testbed's inventory with the default settle window (the testbed's is shorter): the writers here race at
    boot, one of them (cron) 8 s late."""
    return inventory_with(booted, booted.dir / "boot-order.py", {"rig1": {"gpu_power_settle_window_s": 60}})


def cli(booted, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rigforge.cli", *args, str(inventory(booted))],
        capture_output=True,
        text=True,
        timeout=300,
    )


def deploy(booted) -> tuple[dict, str]:
    return pyinfra_run(inventory(booted), REPO / "deploy" / "dual.py")


def test_four_competing_cap_writers_run_at_boot_and_rigforges_caps_are_the_last(booted, testbed_report):
    rig = booted.rig("rig1")
    install_writers(rig)
    results, stderr = deploy(booted)
    assert not errored(results, "rig1"), stderr[-6000:]
    found = cli(booted, "status", "--json")
    writers = json.loads(found.stdout)[0]["power"]["other_writers"]
    assert set(writers) == {
        "nvidia-power-cap.service",
        "homemade-cap.service",
        "gpu-setup.service",
        "@reboot in /etc/cron.d/gpu-cap",
    }, writers
    assert "After=nvidia-persistenced.service\n" in sh(rig, "cat /etc/systemd/system/rigforge-gpu-power.service")

    t0 = time.monotonic()
    res = subprocess.run(
        [sys.executable, "-m", "rigforge.cli", "testbed", "reboot", "rig1", "--dir", str(booted.dir)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    booted_in = time.monotonic() - t0
    # watch the caps until the settle stage is done: when did both cards last become 230 W?
    stable_since, deadline = None, time.monotonic() + 240
    while time.monotonic() < deadline:
        now = caps(rig)
        if now == ["230.00"] * 2:
            stable_since = stable_since or time.monotonic()
        else:
            stable_since = None
        if sh(rig, "systemctl show -p SubState --value rigforge-gpu-settle.service") == "exited":
            break
        time.sleep(0.5)
    settled_in = time.monotonic() - t0
    assert stable_since is not None, f"caps after the settle stage: {caps(rig)}"
    testbed_report.append(
        f"booted boot order: reboot {booted_in:.1f}s; both cards at 230 W for good {stable_since - t0:.1f}s after "
        f"the reboot began; settle stage done {settled_in:.1f}s"
    )

    boot_id = sh(rig, "cat /proc/sys/kernel/random/boot_id")
    ran = sh(rig, f"cat {LOG}").splitlines()
    for writer in WRITERS:
        assert f"{writer} ran {boot_id}" in ran, (writer, ran)
    assert caps(rig) == ["230.00"] * 2
    assert sh(rig, f"systemctl is-active {DUAL}") == "active"
    assert "ordering cycle" not in sh(rig, "journalctl -b --no-pager -o cat")
    for unit in ("rigforge-gpu-power.service", "rigforge-gpu-settle.service"):
        journal = f"journalctl -b -u {unit} --no-pager -o short-monotonic | tail -n 30"
        assert sh(rig, f"systemctl show -p Result --value {unit}") == "success", (unit, sh(rig, journal))

    res = cli(booted, "verify", "--json")
    checks = {c["name"]: c for c in json.loads(res.stdout)["hosts"]["rig1"]["checks"]}
    last = checks["caps set last at this boot"]
    assert last["status"] == "pass", last
    for writer in (
        "nvidia-power-cap.service set 250 W",
        "homemade-cap.service set 250 W",
        "gpu-setup.service set 250 W",
        "@reboot in /etc/cron.d/gpu-cap set 250 W",
    ):
        assert writer in last["detail"], last
    res = cli(booted, "status")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "rig1: power caps: 230 W, set last at this boot (after " in res.stdout, res.stdout
    assert re.search(r"\d+ corrections? by the settle stage[,)]", res.stdout), res.stdout
    assert "; held since by rigforge-gpu-hold.timer (every 15 s)" in res.stdout or "by the hold" in res.stdout

    results, stderr = deploy(booted)
    assert not errored(results, "rig1"), stderr[-4000:]
    assert changed(results, "rig1") == []
