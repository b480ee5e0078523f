"""Tier 4: an interrupted first converge recovers by itself (fresh testbed rigs, real SSH, real apt/dpkg/git/HTTP).

A first `pyinfra deploy/dual_turbo.py` per fresh rig is killed with SIGKILL to pyinfra's whole process group, as
when the controller dies or the link drops, at one point per rig: while dpkg installs Docker's packages, while
git checks out a source, while the weights download, while the compose file is staged. The rig's side of the
killed session is then SIGKILLed too (what a dropped link does to a session at its worst), so nothing of the
killed run finishes behind the test's back. Then one run over all the rigs converges them, and the run after
that changes nothing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest
from support import PYINFRA, REPO, changed, errored, pyinfra_run

pytestmark = pytest.mark.testbed
DEPLOY = REPO / "deploy" / "dual_turbo.py"


def rig_processes(rootfs: Path) -> list[tuple[int, list[str]]]:
    """(pid, argv) of the processes running inside this rig's chroot (its SSH sessions)."""
    out = []
    root = str(rootfs.resolve())
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            if os.readlink(p / "root") != root:
                continue
            argv = (p / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        out.append((int(p.name), [a for a in argv if a]))
    return out


def dpkg_installs_docker(rig) -> bool:
    """dpkg unpacks or configures packages after the driver role held its packages: Docker's (apt hands dpkg a
    temp dir of links, so the package names are not on its command line), and has recorded a change of state
    already (its journal, /var/lib/dpkg/updates, is not empty): a kill now leaves a package half done. A dpkg
    only just started has changed nothing yet, and a kill then would leave nothing to repair."""
    status = (rig.rootfs / "var/lib/dpkg/status").read_text(errors="replace")
    if "Package: nvidia-open\nStatus: hold ok installed" not in status:  # the driver role is done
        return False
    running = any(
        argv and os.path.basename(argv[0]) == "dpkg" and ("--unpack" in argv or "--configure" in argv)
        for _, argv in rig_processes(rig.rootfs)
    )
    return running and any((rig.rootfs / "var/lib/dpkg/updates").iterdir())


def git_checks_out(rig) -> bool:
    """The second source's checkout has begun (git init done, fetch or checkout under way)."""
    return (rig.rootfs / "opt/rigforge/src/genesis/.git").exists()


def weights_download(rig) -> bool:
    parts = list((rig.rootfs / "opt/rigforge/models/.rigforge-staging").rglob("*.part"))
    return bool(parts) and any(p.stat().st_size > 0 for p in parts)


def compose_staged(rig) -> bool:
    return (rig.rootfs / "opt/rigforge/serve/dual-turbo/.staging").exists()


POINTS = {"rig1": dpkg_installs_docker, "rig2": git_checks_out, "rig3": weights_download, "rig4": compose_staged}


def killed_first_converge(tb, name: str, trigger, timeout: float = 1200) -> dict:
    """Run the first converge of rig `name` and SIGKILL it (process group, then the rig's session) on `trigger`."""
    rig = tb.rig(name)
    log = tempfile.NamedTemporaryFile(prefix=f"rigforge-kill-{name}-", suffix=".log", delete=False)
    proc = subprocess.Popen(
        [PYINFRA, "-y", str(tb.inventory), str(DEPLOY), "--limit", name],
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group, as a user's terminal gives it
    )
    deadline = time.monotonic() + timeout
    fired = False
    while proc.poll() is None and time.monotonic() < deadline:
        if trigger(rig):
            os.killpg(proc.pid, signal.SIGKILL)
            for pid, _ in rig_processes(rig.rootfs):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            fired = True
            break
        time.sleep(0.05)
    if not fired and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    text = Path(log.name).read_text()
    Path(log.name).unlink()
    return {"fired": fired, "rc": proc.returncode, "log": text[-4000:]}


@pytest.fixture(scope="module")
def recovered(testbed_factory):
    from rigforge.testbed import RigSpec

    tb = testbed_factory([RigSpec() for _ in POINTS], name="recover")
    tb.hf_control(throttle_bps=64 * 1024)  # slow enough (256 KiB shards) that the kill lands mid-download
    kills: dict[str, dict] = {}
    try:
        threads = [
            threading.Thread(target=lambda n=n, t=t: kills.__setitem__(n, killed_first_converge(tb, n, t)))
            for n, t in POINTS.items()
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        tb.hf_control()
    left = {name: tb.rig(name).run("ls -A /var/lib/dpkg/updates; dpkg --audit").stdout for name in POINTS}
    second, err2 = pyinfra_run(tb.inventory, DEPLOY)
    third, err3 = pyinfra_run(tb.inventory, DEPLOY)
    return tb, kills, left, (second, err2), (third, err3)


def test_each_kill_landed_where_intended(recovered):
    _, kills, left, *_ = recovered
    for name, kill in kills.items():
        assert kill["fired"], f"{name}: {POINTS[name].__name__} never seen before the run ended:\n{kill['log']}"
        assert kill["rc"] == -signal.SIGKILL, kill
    assert left["rig1"].strip(), "killing dpkg mid-install should leave dpkg interrupted"


def test_next_run_repairs_and_converges(recovered):
    tb, _, left, (second, err), _ = recovered
    assert second["failed_hosts"] == [], err[-6000:]
    for name in POINTS:
        assert errored(second, name) == [], err[-6000:]
        rig = tb.rig(name)
        assert rig.run("dpkg --audit; ls -A /var/lib/dpkg/updates").stdout.strip() == ""
        assert "rigforge-vllm@dual-turbo.service" in rig.run("ls /etc/systemd/system/multi-user.target.wants").stdout
        leftovers = "/opt/rigforge/serve/dual-turbo/.staging /opt/rigforge/models/.rigforge-staging/autoround-int4"
        assert rig.run(f"ls -d {leftovers} 2>/dev/null").stdout == ""
        assert rig.run("ls -A /tmp/.rigforge-upload-rigadmin 2>/dev/null").stdout == ""
        assert rig.run("ls /opt/rigforge/run/weights/*.token 2>/dev/null").stdout == ""
    assert "an earlier run was interrupted" in err and "dpkg --configure -a" in err
    repair = next(op for op in second["operations"] if "Repair packages" in op["name"])
    assert "rig1" in repair["success"], repair


def test_the_run_after_changes_nothing(recovered):
    *_, (third, err) = recovered
    assert third["failed_hosts"] == [], err[-4000:]
    assert changed(third) == [], f"third run changed: {changed(third)}"
