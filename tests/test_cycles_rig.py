"""A boot-order cycle through rigforge's units, on a chroot testbed rig converged by the real deploy, named by
`rigforge verify` and `rigforge status` as a user runs them (issue 47): a user's unit After=docker.service and
Before=rigforge-gpu-power.service, enabled, closes a cycle with rigforge's order (the power unit Before=docker.service).
No systemd runs in a chroot, so nothing can be booted here: the cycle is found by `systemd-analyze verify`.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from support import changed, pyinfra_run

pytestmark = pytest.mark.testbed
REPO = Path(__file__).resolve().parents[1]
NAME = "boot order has no cycle"
POWER = "rigforge-gpu-power.service"
USER_UNIT = "/etc/systemd/system/user-thing.service"
UNIT_TEXT = """[Unit]
Description=a user's unit between Docker and the GPU caps
After=docker.service
Before=rigforge-gpu-power.service

[Service]
Type=oneshot
ExecStart=/bin/true

[Install]
WantedBy=multi-user.target
"""
RING = f"ordering cycle: {POWER} -> docker.service -> user-thing.service -> {POWER} (each ordered before the next"


def rigforge(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rigforge.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def rig(testbed_factory, converged_image):
    """One testbed rig provisioned as dual-turbo by the real deploy (a copy of conftest's converged_image; the run
    here changes nothing); (testbed, rig)."""
    from rigforge.testbed import RigSpec

    tb = testbed_factory([RigSpec()], name="cycles", image=converged_image)
    results, err = pyinfra_run(tb.inventory, REPO / "deploy" / "dual_turbo.py")
    assert results["failed_hosts"] == [] and changed(results) == [], err[-4000:]
    yield tb, tb.rig("rig1")
    testbed_factory.release(tb)


def test_a_users_unit_closing_a_cycle_is_named_by_verify_and_status(rig):
    tb, r = rig
    code, report = verify(tb.inventory)
    check = next(c for c in report["hosts"]["rig1"]["checks"] if c["name"] == NAME)
    assert (code, check["status"]) == (0, "pass"), report
    assert check["detail"] == "no ordering cycle through rigforge's units (systemd-analyze verify default.target)"

    wants = "/etc/systemd/system/multi-user.target.wants/user-thing.service"
    r.run(f"printf %s {shlex.quote(UNIT_TEXT)} > {USER_UNIT} && ln -s {USER_UNIT} {wants}", check=True)
    try:
        code, report = verify(tb.inventory)
        checks = {c["name"]: c for c in report["hosts"]["rig1"]["checks"]}
        assert code == 1 and checks[NAME]["status"] == "fail", checks
        assert checks[NAME]["detail"] == (
            f"{RING}; systemd-analyze verify), at boot systemd breaks it by dropping one of these start jobs (which "
            f"one can change each boot); remove the After=/Before= that closes it: {USER_UNIT} (After=docker.service, "
            f"Before={POWER})"
        )
        assert [n for n, c in checks.items() if c["status"] == "fail"] == [NAME]  # nothing else is wrong
        text = rigforge("verify", str(tb.inventory))
        line = next(line for line in text.stdout.splitlines() if NAME in line)
        assert " FAIL " in line and RING in line and text.returncode == 1, text.stdout
        assert f"FAILED rig1: {NAME}" in text.stdout.splitlines()[-1]

        status = rigforge("status", str(tb.inventory), "--json")
        (row,) = json.loads(status.stdout)
        said = next(c for c in row["checks"] if c["name"] == NAME)
        assert said["status"] == "fail" and RING in said["detail"] and USER_UNIT in said["detail"]
        table = rigforge("status", str(tb.inventory)).stdout
        assert f"rig1: DRIFT {NAME}: {RING}" in table, table
    finally:
        r.run(f"rm -f {USER_UNIT} {wants}", check=True)
    assert verify(tb.inventory)[0] == 0


def verify(inventory) -> tuple[int, dict]:
    proc = rigforge("verify", str(inventory), "--json")
    assert proc.stdout, proc.stderr
    return proc.returncode, json.loads(proc.stdout)
