"""Tier 4 (issue 32): what can be checked before the first change is, on FRESH testbed rigs.

Each case sets the rig up as a user's rig may be (a hand-edited /etc/docker/daemon.json, ...), takes a snapshot
(installed packages, holds, every file under /etc/apt, /etc/docker, /etc/systemd/system and /opt/rigforge with
its checksum), runs the user's entry point over real SSH, and compares: a refused run leaves the rig byte-identical,
and `pyinfra --dry` exits 1 with the same line.
"""

from __future__ import annotations

import os
import shlex
import subprocess

import pytest
from support import PYINFRA, REPO, changed, inventory_with, pyinfra_run

pytestmark = pytest.mark.testbed
TREES = "/etc/apt /etc/docker /etc/systemd/system /opt/rigforge"
SNAPSHOT = (
    "dpkg -l | sort; echo '-- holds'; apt-mark showhold | sort; echo '-- files'; "
    f"find {TREES} -xdev -printf '%p %s %m %l\\n' 2>/dev/null | sort; "
    f"find {TREES} -xdev -type f -exec sha256sum {{}} + 2>/dev/null | sort"
)
NO_TOKEN = {"RIGFORGE_HF_TOKEN": "", "HF_TOKEN": ""}


@pytest.fixture(scope="module")
def rigs(testbed_factory):
    """rig1: a fresh 2x 24 GB rig every case leaves as it found it."""
    from rigforge.testbed import RigSpec

    return testbed_factory([RigSpec()], name="checks")


def snapshot(rig) -> str:
    return rig.run(SNAPSHOT).stdout


def refused(tb, tmp_path, rig: str, data: dict, expect: str, header: str, entry: str = "dual_turbo") -> str:
    """Deploy `entry` on `rig`, then the same with `--dry`: both refuse the host with the line `expect`, under
    `header`, before any change, and exit non-zero; returns the line as the run printed it."""
    inv = inventory_with(tb, tmp_path / f"inv-{rig}.py", {rig: data})
    results, err = pyinfra_run(inv, REPO / "deploy" / f"{entry}.py", "--limit", rig, env=NO_TOKEN)
    assert results.get("failed_hosts") in ("all", [rig]), err[-3000:]
    assert f"{header} {rig}:" in err and expect in err, err[-4000:]
    assert err.count(f"{header} {rig}:") == 1 and changed(results, rig) == []
    (line,) = {line for line in err.splitlines() if expect in line}
    proc = subprocess.run(
        [PYINFRA, "--dry", str(inv), str(REPO / "deploy" / f"{entry}.py"), "--limit", rig],
        cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, **NO_TOKEN},
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-4000:]
    assert line in out.splitlines(), out[-4000:]
    return line


@pytest.mark.parametrize(
    "text",
    ['{\n  // the nvidia runtime goes here\n  "log-driver": "json-file"\n}\n', '{\n  "log-driver": "json-file",\n}\n'],
    ids=["comment", "trailing-comma"],
)
def test_an_invalid_daemon_json_is_refused_before_the_first_change(rigs, tmp_path, text):
    rig = rigs.rig("rig1")
    assert rig.run("test -e /etc/docker").returncode == 1  # a fresh rig: no Docker config yet
    rig.run(f"mkdir -p /etc/docker && printf %s {shlex.quote(text)} > /etc/docker/daemon.json", True)
    try:
        before = snapshot(rig)
        assert "/etc/docker/daemon.json" in before and "docker.io" not in before
        line = refused(rigs, tmp_path, "rig1", {}, "/etc/docker/daemon.json on rig1 is not valid JSON (",
                       "preflight failed on")  # fmt: skip
        assert line.endswith("fix it (no comments, no trailing commas) or remove it, then re-run."), line
        assert snapshot(rig) == before
    finally:
        rig.run("rm -rf /etc/docker", True)
