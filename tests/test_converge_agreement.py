"""Tier 4 (issue 47, one verdict): `rigforge status` and the deploy say the same thing about a rig.

A rig converged by deploy/dual_turbo.py (second run: zero changes) is perturbed one way at a time. Each time,
`rigforge status --json` and `pyinfra --dry` must agree: status shows a failed check whose detail names the
difference exactly when the dry run would change something. Then one real run repairs it, after which status is
clean and `pyinfra --dry` changes nothing. Both sides decide through the same function per resource
(rigforge/observe/verdict.py), so a disagreement here is a resource decided twice.

The testbed's chroot rigs run no systemd (services are not managed): the cases that need a running unit are the
booted tier's (tests/testbed/).
"""

import json
import subprocess
import sys

import pytest
from support import PYINFRA, REPO, changed, errored, pyinfra_run

pytestmark = pytest.mark.testbed
DEPLOY = REPO / "deploy" / "dual_turbo.py"
MODELS = "/opt/rigforge/models/qwen3.6-27b-autoround-int4"
WEIGHT = f"{MODELS}/model-00002-of-00003.safetensors"
SERVE = "/opt/rigforge/serve/dual-turbo"
GENESIS = "/opt/rigforge/src/genesis"
UNITS = "/etc/systemd/system"
DRIVER_PACKAGE = "nvidia-open"  # the driver table's package on Debian 13 (held by the driver role)

# case: (shell change on the rig, a word the failed check's detail must hold)
PERTURB = {
    "weights file deleted": (f"rm {WEIGHT}", "model-00002-of-00003.safetensors missing"),
    "weights file rewritten at the same size": (
        f"size=$(stat -c %s {WEIGHT}); head -c $size /dev/zero > {WEIGHT}",
        "modified since it was verified",
    ),
    "checkout on another commit": (
        f"git -C {GENESIS} -c user.name=x -c user.email=x@x commit -q --allow-empty -m local",
        "git genesis: HEAD",
    ),
    "checkout's remote URL changed": (
        f"git -C {GENESIS} remote set-url origin https://example.invalid/genesis.git",
        "git genesis: origin is https://example.invalid/genesis.git",
    ),
    "compose file edited": (f"echo '# edit' >> {SERVE}/docker-compose.yml", "docker-compose.yml differs"),
    ".env edited": (f"echo 'EXTRA=1' >> {SERVE}/.env", ".env differs"),
    ".env made world-readable": (f"chmod 644 {SERVE}/.env", ".env has mode 644"),
    "vLLM unit file edited": (f"echo '# edit' >> {UNITS}/rigforge-vllm@.service", "rigforge-vllm@.service differs"),
    "power cap changed": ("nvidia-smi -i 1 -pl 300 >/dev/null", "GPU1 at 300 W, declared 230 W"),
    "persistence mode off": ("nvidia-smi -i 0 -pm 0 >/dev/null", "persistence mode off on GPU 0"),
    "driver unheld": (f"apt-mark unhold {DRIVER_PACKAGE} >/dev/null", f"{DRIVER_PACKAGE} is not held"),
    "nvidia runtime removed from daemon.json": (
        "python3 -c \"import json; p='/etc/docker/daemon.json'; d=json.load(open(p)); d.pop('runtimes');"
        " json.dump(d, open(p, 'w'))\"",
        "runtimes is not as declared",
    ),
    "docker CLI removed": (
        "DEBIAN_FRONTEND=noninteractive apt-get remove -y -qq docker-cli >/dev/null",
        "docker-cli is not installed",
    ),
    "docker CLI binary deleted": ("rm /usr/bin/docker", "/usr/bin/docker is missing, its package installed"),
    "vLLM unit disabled": ("systemctl disable -q rigforge-vllm@dual-turbo.service", "not enabled"),
    "power unit disabled": ("systemctl disable -q rigforge-gpu-power.service", "rigforge-gpu-power.service is not"),
    "rig.json removed": ("rm /etc/rigforge/rig.json", "no readable /etc/rigforge/rig.json"),
    "toolkit binary deleted": ("rm /usr/bin/nvidia-ctk", "/usr/bin/nvidia-ctk is missing, its package installed"),
}


@pytest.fixture(scope="module")
def rig(testbed_factory, converged_image):
    """A copy of the converged rig (conftest's converged_image: two runs of DEPLOY, the second changed nothing);
    a run on the copy changes nothing either."""
    from rigforge.testbed import RigSpec

    tb = testbed_factory([RigSpec()], name="agreement", image=converged_image)
    again, err = pyinfra_run(tb.inventory, DEPLOY)
    assert not errored(again, "rig1") and changed(again, "rig1") == [], err[-3000:]
    return tb


def status(inventory) -> dict:
    """rig1's row of `rigforge status --json`."""
    proc = subprocess.run(
        [sys.executable, "-m", "rigforge.cli", "status", str(inventory), "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = [r for r in json.loads(proc.stdout) if r["host"] == "rig1"]
    return row


def differences(row: dict) -> list[str]:
    """What status says differs on the rig: its failed checks (name: detail), its problems and its pin drift."""
    failed = [f"{c['name']}: {c['detail']}" for c in row["checks"] if c["status"] == "fail"]
    return failed + list(row["problems"] or []) + list(row["pin_drift"] or [])


def would_change(inventory) -> list[str]:
    """The operations `pyinfra --dry` plans to change on rig1 (its JSON plan's `hosts_with_change`: not those that
    would only run because another changed)."""
    proc = subprocess.run(
        [PYINFRA, "--dry", "--json", str(inventory), str(DEPLOY)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [op["name"] for op in json.loads(proc.stdout)["plan"] if "rig1" in op["hosts_with_change"]]


def test_a_converged_rig_is_clean_to_both(rig):
    assert differences(status(rig.inventory)) == []
    assert would_change(rig.inventory) == []


@pytest.mark.parametrize("case", list(PERTURB))
def test_status_and_the_deploy_agree_then_one_run_repairs(rig, case):
    change, named = PERTURB[case]
    res = rig.rig("rig1").run(change)
    assert res.returncode == 0, res.stderr
    said = differences(status(rig.inventory))
    plan = would_change(rig.inventory)
    assert said and plan, (case, said, plan)  # both see it
    assert any(named in line for line in said), (case, said)  # and status names it
    results, err = pyinfra_run(rig.inventory, DEPLOY)
    assert not errored(results, "rig1"), err[-3000:]
    assert changed(results, "rig1"), case
    assert differences(status(rig.inventory)) == [], case  # repaired in one run: both clean again
    assert would_change(rig.inventory) == [], case
