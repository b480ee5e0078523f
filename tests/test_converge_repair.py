"""Tier 4: drift of every kind of managed thing is detected and repaired in one run, on a testbed rig.

A rig converged by deploy/dual_turbo.py (second run: zero changes) is changed by hand, one kind at a time -- a
managed file, a package, a hold, a unit, a GPU power cap, a checkout (a local commit; an untracked file), a weight file
no longer matching its stamp -- and the next run must repair exactly that, with nothing else changed; the run
after the last repair changes nothing. No-op runs read the rig from one batched probe (rigforge/observe/facts/probe.py):
each perturbation here is the first change of its run, so it is seen through that snapshot.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
from support import REPO, changed, errored, pyinfra_run

from rigforge.model.driver_table import packages_for
from rigforge.model.knobs.nvidia_driver import NvidiaDriver

pytestmark = pytest.mark.testbed
DEPLOY = REPO / "deploy" / "dual_turbo.py"
NOUVEAU = "/etc/modprobe.d/rigforge-blacklist-nouveau.conf"
WEIGHT = "/opt/rigforge/models/qwen3.6-27b-autoround-int4/model-00002-of-00003.safetensors"
STAMP = "/opt/rigforge/models/qwen3.6-27b-autoround-int4/.rigforge-stamp.json"
WANTS = "/etc/systemd/system/multi-user.target.wants/rigforge-gpu-power.service"
DRIVER = packages_for(NvidiaDriver(), "debian").install[0]  # held by the driver role (testbed: Debian 13)

# kind: (shell change on the rig, operations that must repair it, shell check that must pass afterwards)
PERTURB = {
    "file": (
        f"echo '# local edit' >> {NOUVEAU}",
        ["Blacklist the nouveau driver", "Rebuild the initramfs without nouveau"],
        f"! grep -q 'local edit' {NOUVEAU}",
    ),
    "package": (
        "apt-mark unhold nvidia-container-toolkit >/dev/null && "
        "DEBIAN_FRONTEND=noninteractive apt-get remove -y -qq nvidia-container-toolkit",
        ["Install the NVIDIA Container Toolkit", "Hold the NVIDIA Container Toolkit packages"],
        "dpkg-query -W -f '${db:Status-Status}' nvidia-container-toolkit | grep -qx installed",
    ),
    "hold": (
        f"apt-mark unhold {DRIVER}",
        ["Hold the NVIDIA driver packages"],
        f"apt-mark showhold | grep -qx {DRIVER}",
    ),
    "unit": (f"rm {WANTS}", ["Enable rigforge-gpu-power.service at boot"], f"test -L {WANTS}"),
    "cap": (
        "nvidia-smi -i 1 -pl 300 >/dev/null",
        ["Cap GPU power at 230 W"],
        "nvidia-smi --query-gpu=power.limit --format=csv,noheader,nounits | grep -vx 230.00 | wc -l | grep -qx 0",
    ),
    "checkout HEAD": (
        "git -C /opt/rigforge/src/genesis -c user.name=x -c user.email=x@x commit -q --allow-empty -m local",
        ["Check out genesis at"],
        'test "$(git -C /opt/rigforge/src/genesis log -1 --format=%s)" != local',
    ),
    "dirty checkout": (
        "echo junk > /opt/rigforge/src/club-3090/NOTES.txt",
        ["Check out club-3090 at"],
        "test ! -e /opt/rigforge/src/club-3090/NOTES.txt",
    ),
    "stamp": (
        f"touch -d 2020-01-01 {WEIGHT}",
        ["Weights autoround-int4"],
        f"python3 -c \"import json,os; e=json.load(open('{STAMP}'))['files']['{WEIGHT.rsplit('/', 1)[1]}'];"
        f" assert e['mtime_ns'] == os.stat('{WEIGHT}').st_mtime_ns\"",
    ),
}


@pytest.fixture(scope="module")
def rig(testbed_factory, converged_image):
    """A copy of the converged rig (conftest's converged_image: two runs of DEPLOY, the second changed nothing);
    a run on the copy changes nothing either."""
    from rigforge.testbed import RigSpec

    tb = testbed_factory([RigSpec()], name="repair", image=converged_image)
    again, err = pyinfra_run(tb.inventory, DEPLOY)
    assert not errored(again, "rig1") and changed(again, "rig1") == [], err[-3000:]
    return tb


@pytest.mark.parametrize("kind", list(PERTURB))
def test_drift_is_repaired_in_one_run(rig, kind):
    change, repairs, check = PERTURB[kind]
    r = rig.rig("rig1")
    res = r.run(change)
    assert res.returncode == 0, res.stderr
    results, err = pyinfra_run(rig.inventory, DEPLOY)
    assert not errored(results, "rig1"), err[-3000:]
    done = changed(results, "rig1")
    assert all(any(want in name for name in done) for want in repairs), (kind, done)
    assert all(any(want in name for want in repairs) for name in done), (kind, done)  # nothing else
    res = r.run(check)
    assert res.returncode == 0, (kind, res.stdout, res.stderr)
    again, err = pyinfra_run(rig.inventory, DEPLOY)
    assert changed(again, "rig1") == [], (kind, err[-3000:])


def test_a_no_op_run_reads_the_rig_in_one_round_trip(rig, tmp_path):
    """After a run has recorded the facts a deploy reads, the next no-op run reads them all in one batched probe
    (rigforge/observe/facts/probe.py): every fact read is served from it, none goes to the rig on its own."""
    inventory = tmp_path / "inventory.py"
    inventory.write_text(
        f"exec(open({str(rig.inventory)!r}).read())\n"
        "rigs = [(n, {**d, 'rigforge_variant': 'dual-turbo'}) for n, d in rigs]\n"
    )
    timings = tmp_path / "timings.jsonl"
    timed = REPO / "benchmarks" / "timed_site.py"  # deploy/site.py, recording how each fact read was answered
    for _ in range(2):  # the first run records this deploy file's facts, the second reads them in one probe
        timings.unlink(missing_ok=True)
        results, err = pyinfra_run(inventory, timed, env={"RIGFORGE_TIMINGS": str(timings)})
        assert changed(results, "rig1") == [], err[-3000:]
    reads = [json.loads(line) for line in timings.read_text().splitlines() if '"kind": "fact"' in line]
    how = Counter(r["how"] for r in reads)
    assert how["probe"] == 1 and how["live"] == 0, (how, [r["fact"] for r in reads if r["how"] == "live"])
    assert how["served"] >= 60, how
