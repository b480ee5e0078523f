"""Tier 4: one rigforge run per rig (a fresh testbed rig, real SSH, real flock on the rig).

While a run holds a rig (here: a process that takes the rig's lock as a deploy does and keeps its SSH
connection open), a second deploy stops before it changes anything, in one line naming the holder. Then the
holder's side on the rig is killed (SIGKILL, as when the link drops and the session dies before it can tidy
up): the lock frees itself, the next deploy says it found the gone run's lock and converges, and the one after
changes nothing (taking the lock is not a change).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from support import FIRST_RIG_CONNECTED, PYINFRA, REPO, changed, pyinfra_run

pytestmark = pytest.mark.testbed
DEPLOY = REPO / "deploy" / "dual_turbo.py"
HOLDER = (
    FIRST_RIG_CONNECTED
    + """
from roles import rig_lock
from rigforge.layout import RUN_LOCK
rig_lock.send(host, RUN_LOCK, True)
print(rig_lock.take(host), flush=True)
sys.stdin.read()  # hold until the test closes stdin
"""
)


def test_a_second_run_stops_in_one_line_while_another_holds_the_rig(testbed_factory):
    from rigforge.testbed import RigSpec

    tb = testbed_factory([RigSpec()], name="lock")
    rig = tb.rig("rig1")
    before = rig.run("dpkg-query -W -f '${Package}\\n' | sort; ls -R /etc/apt /opt 2>/dev/null").stdout
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tb.inventory)],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "(None, None)"  # the holder has the lock
        proc = subprocess.run(
            [PYINFRA, "-y", str(tb.inventory), str(DEPLOY)], cwd=REPO, capture_output=True, text=True, timeout=600
        )
    finally:
        killed = kill_lock_holder_on(rig)
        holder.stdin.close()
        holder.wait(timeout=60)
    assert killed, "no lock holder ran on the rig"
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    refused = [line for line in out.splitlines() if "rigforge refused" in line]
    assert len(refused) == 1 and "rig1 is being provisioned by" in refused[0] and ", pid " in refused[0], refused
    assert "nothing was changed" in refused[0]
    after = rig.run("dpkg-query -W -f '${Package}\\n' | sort; ls -R /etc/apt /opt 2>/dev/null").stdout
    assert after == before
    time.sleep(1)
    results, err = pyinfra_run(tb.inventory, DEPLOY)
    assert results["failed_hosts"] == [], err[-4000:]
    assert "rig1: found the lock of an earlier run that is gone (" in err and "this run takes it over" in err
    again, err = pyinfra_run(tb.inventory, DEPLOY)
    assert again["failed_hosts"] == [] and changed(again) == [], err[-3000:]


def kill_lock_holder_on(rig) -> list[int]:
    """SIGKILL the rig-side holder of the rig's lock (its shell and the `cat` under it), found on the controller
    by its command line and its root directory (the rig's chroot: other testbeds' rigs are left alone)."""
    found = subprocess.run(["pgrep", "-f", "flock -n 9"], capture_output=True, text=True).stdout.split()
    mine = [int(pid) for pid in found if os.path.realpath(f"/proc/{pid}/root") == os.path.realpath(rig.rootfs)]
    children = [
        int(child)
        for pid in mine
        for child in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    ]
    for pid in dict.fromkeys(children + mine):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return mine
