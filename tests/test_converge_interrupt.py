"""Tier 4: an interrupted run exits non-zero and names the operation it cut (a fresh testbed rig, real SSH).

pyinfra's own command line answers Ctrl-C with "Exiting upon user request!" and exit code 0; a deploy through
rigforge exits 130 on SIGINT and 143 on SIGTERM, as a shell reports a process killed by that signal, and says
which operation was running on which rig. The next run finishes the job.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from support import PYINFRA, REPO, pyinfra_run
from test_converge_recover import rig_processes

pytestmark = pytest.mark.testbed
DEPLOY = REPO / "deploy" / "dual_turbo.py"


def interrupted(tb, signum: int, trigger, timeout: float = 900) -> tuple[int, str]:
    """A first converge of rig1, sent `signum` (to its process group, as a terminal's Ctrl-C) on `trigger`."""
    log = tempfile.NamedTemporaryFile(prefix="rigforge-int-", suffix=".log", delete=False)
    proc = subprocess.Popen(
        [PYINFRA, "-y", str(tb.inventory), str(DEPLOY)],
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline and not trigger(tb.rig("rig1")):
        time.sleep(0.05)
    if proc.poll() is None:
        os.killpg(proc.pid, signum)
    proc.wait(timeout=60)
    for pid, _ in rig_processes(tb.rig("rig1").rootfs):  # the rig's side of the cut session, left running
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    text = Path(log.name).read_text()
    Path(log.name).unlink()
    return proc.returncode, text


def downloading(rig) -> bool:
    return any((rig.rootfs / "opt/rigforge/models").rglob("*.part"))


def test_sigint_and_sigterm_exit_non_zero_naming_the_cut_operation(testbed_factory):
    from rigforge.testbed import RigSpec

    tb = testbed_factory([RigSpec()], name="interrupt")
    rc, text = interrupted(tb, signal.SIGINT, lambda rig: (rig.rootfs / "opt/rigforge/src/genesis/.git").exists())
    assert rc == 130, text[-3000:]
    assert "rigforge: interrupted by SIGINT, cut during rig1: rigforge site | Pinned git sources" in text, text[-3000:]
    assert "Success" not in text.split("interrupted by SIGINT")[-1]
    tb.hf_control(throttle_bps=64 * 1024)  # slow enough that the signal lands mid-download
    try:
        rc, text = interrupted(
            tb, signal.SIGTERM, lambda rig: any((rig.rootfs / "opt/rigforge/models").rglob("*.part"))
        )
    finally:
        tb.hf_control()
    assert rc == 143, text[-3000:]
    assert "rigforge: interrupted by SIGTERM, cut during rig1: rigforge site | Verified model weights" in text
    results, err = pyinfra_run(tb.inventory, DEPLOY)
    assert results["failed_hosts"] == [], err[-4000:]
