"""`rigforge status` and `rigforge verify` against testbed rigs over real SSH.

Two rigs are provisioned for real with `pyinfra -y INVENTORY deploy/dual_turbo.py` (simulated GPUs, no
systemd: services are installed and enabled, not started). Each test then changes one thing the way it
goes wrong on a real rig -- a cap moved with `nvidia-smi -pl`, a checkout moved, a weight file grown, a
lock moved ahead of the rigs, an unreachable host -- runs the command as a user would (a subprocess), and
puts the rig back. Variants of the inventory (an extra unreachable host, another lock, a served port) are
written next to the test, from the testbed's own host data.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support import changed, pyinfra_run

REPO = Path(__file__).resolve().parents[1]
SKIPPED = "skipped (services not managed on this host)"
CHECKS = [
    "manifest present",
    "driver module = package",
    "CUDA driver >= image",
    "GPUs visible",
    "VRAM fits variant",
    "power caps hold",
    "persistence mode on",
    "caps set last at this boot",
    "nvidia runtime",
    "boot order has no cycle",
    "sources at locked SHAs",
    "weights stamp valid",
    "files as rendered",
    "packages as declared",
    "units enabled at boot",
    "pins as locked",
    "unit enabled",
    "unit active",
    "container runs the locked digest",
    "/v1/models answers",
    "chat returns text",
    "tool call returned",
]
SERVICE_CHECKS = ["caps set last at this boot", *CHECKS[-5:]]


def rigforge(cmd: str, inventory: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rigforge.cli", cmd, str(inventory), *extra],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def verify_json(inventory: Path) -> tuple[int, dict]:
    r = rigforge("verify", inventory, "--json")
    assert r.stdout, r.stderr
    return r.returncode, json.loads(r.stdout)


def status_json(inventory: Path) -> tuple[int, dict]:
    r = rigforge("status", inventory, "--json")
    assert r.stdout, r.stderr
    return r.returncode, {row["host"]: row for row in json.loads(r.stdout)}


def checks_of(report: dict, host: str) -> dict[str, dict]:
    return {c["name"]: c for c in report["hosts"][host]["checks"]}


def inventory_rigs(inventory: Path) -> list[tuple[str, dict]]:
    scope: dict = {}
    exec(inventory.read_text(), scope)
    return [(name, dict(data)) for name, data in scope["rigs"]]


def write_inventory(path: Path, rigs: list[tuple[str, dict]]) -> Path:
    path.write_text('"""Test inventory derived from the testbed\'s."""\n\nrigs = ' + repr(rigs) + "\n")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def rigs(testbed_factory, converged_image):
    """Two testbed rigs provisioned as dual-turbo by the real deploy (copies of conftest's converged_image; the run
    here changes nothing on either)."""
    from rigforge.testbed import RigSpec

    tb = testbed_factory([RigSpec(), RigSpec()], name="opsverify", image=converged_image)
    results, err = pyinfra_run(tb.inventory, REPO / "deploy" / "dual_turbo.py")
    assert results["failed_hosts"] == [] and changed(results) == [], err[-4000:]
    return tb


# ---------------------------------------------------------------- converged rigs


@pytest.mark.testbed
def test_status_one_row_per_rig(rigs):
    code, rows = status_json(rigs.inventory)
    assert code == 0
    assert sorted(rows) == ["rig1", "rig2"]
    for row in rows.values():
        assert row["error"] is None
        assert (row["variant"], row["variant_from"]) == ("dual-turbo", "/etc/rigforge/rig.json")
        assert row["pin_drift"] == []
        assert row["pins"]["git"]["genesis"] == rigs.git_commits["genesis"][-1]
        assert [(g["index"], g["name"]) for g in row["gpus"]] == [
            (0, "NVIDIA GeForce RTX 3090"),
            (1, "NVIDIA GeForce RTX 3090"),
        ]
        assert all(g["power_limit_w"] == g["target_w"] == 230 and g["cap_ok"] for g in row["gpus"])
        assert all(g["persistence_mode"] is True and g["memory_total_mib"] == 24576 for g in row["gpus"])
        assert row["service"] == {
            "unit": "rigforge-vllm@dual-turbo.service",
            "enabled": True,
            "active": "unknown",
            "serving": "unknown",
            "rest": None,
        }
        assert row["api"]["reachable"] is False and "services not managed on this host" in row["api"]["detail"]
        assert row["provisioned_at"]
        assert row["cuda"] == {"driver": "13.0", "image": "13.0"}  # the stub's header, the testbed lock's cuda

    table = rigforge("status", rigs.inventory).stdout.splitlines()
    assert table[0].split()[:4] == ["HOST", "VARIANT", "PINS", "GPUS"]
    assert [line.split()[:3] for line in table[1:3]] == [["rig1", "dual-turbo", "ok"], ["rig2", "dual-turbo", "ok"]]
    assert "0:230/230 1:230/230" in table[1]


@pytest.mark.testbed
def test_verify_passes_with_service_checks_skipped_on_the_testbed(rigs):
    code, report = verify_json(rigs.inventory)
    assert code == 0, report
    for host in ("rig1", "rig2"):
        checks = checks_of(report, host)
        assert list(checks) == CHECKS
        for name, c in checks.items():
            if name in SERVICE_CHECKS:  # unit enabled is checked; active/API need a running service
                assert (c["status"], c["detail"]) == ("skip", SKIPPED)
            else:
                assert c["status"] == "pass", c
    text = rigforge("verify", rigs.inventory)
    assert text.returncode == 0
    lines = [" ".join(line.split()) for line in text.stdout.splitlines()]  # the columns' padding aside
    assert f"rig1 SKIP unit active {SKIPPED}" in lines
    assert f"rig1 SKIP container runs the locked digest {SKIPPED}" in lines
    assert "rig1 PASS CUDA driver >= image CUDA: driver 13.0, image 13.0" in lines
    summary = "2 rig(s): all checks passed; skipped on rig1, rig2: services not managed on this host"
    assert text.stdout.splitlines()[-1] == summary


# ---------------------------------------------------------------- drift


@pytest.mark.testbed
def test_drifted_cap_fails_verify_naming_the_check(rigs):
    rig1 = rigs.rig("rig1")
    rig1.run("nvidia-smi -pl 300 -i 1", check=True)
    try:
        code, report = verify_json(rigs.inventory)
        text = rigforge("verify", rigs.inventory)
        _, rows = status_json(rigs.inventory)
    finally:
        rig1.run("nvidia-smi -pl 230 -i 1", check=True)
    assert code == 1 and text.returncode == 1
    cap = checks_of(report, "rig1")["power caps hold"]
    assert cap["status"] == "fail" and "GPU1 at 300 W, declared 230 W" in cap["detail"]
    assert [n for n, c in checks_of(report, "rig1").items() if c["status"] == "fail"] == ["power caps hold"]
    assert all(c["status"] != "fail" for c in checks_of(report, "rig2").values())
    assert any(line.startswith("rig1  FAIL   power caps hold") for line in text.stdout.splitlines())
    assert "FAILED rig1: power caps hold" in text.stdout.splitlines()[-1]
    assert [g["cap_ok"] for g in rows["rig1"]["gpus"]] == [True, False]
    assert rows["rig1"]["gpus"][1]["power_limit_w"] == 300.0


@pytest.mark.testbed
def test_moved_checkout_and_grown_weight_file_fail_their_checks(rigs):
    rig2 = rigs.rig("rig2")
    old = rigs.git_commits["genesis"][0]
    weights = "/opt/rigforge/models/qwen3.6-27b-autoround-int4/config.json"
    size = int(rig2.run(f"stat -c %s {weights}", check=True).stdout)
    rig2.run(f"touch -r {weights} /tmp/mtime-ref", check=True)  # to put back the stamped mtime too
    rig2.run(f"git -C /opt/rigforge/src/genesis checkout -q {old} && printf x >> {weights}", check=True)
    try:
        code, report = verify_json(rigs.inventory)
    finally:
        pin = rigs.git_commits["genesis"][-1]
        rig2.run(f"git -C /opt/rigforge/src/genesis checkout -q {pin} && truncate -s {size} {weights}", check=True)
        rig2.run(f"touch -r /tmp/mtime-ref {weights}", check=True)
    assert code == 1
    checks = checks_of(report, "rig2")
    assert checks["sources at locked SHAs"]["status"] == "fail"
    assert (
        f"genesis: HEAD {old[:12]}, lock {rigs.git_commits['genesis'][-1][:12]}"
        in checks["sources at locked SHAs"]["detail"]
    )
    assert checks["weights stamp valid"]["status"] == "fail"
    assert f"config.json is {size + 1} bytes, lock {size}" in checks["weights stamp valid"]["detail"]
    assert verify_json(rigs.inventory)[0] == 0  # put back: passes again


@pytest.mark.testbed
def test_a_card_off_the_bus_is_named_by_its_bus_address_and_no_file_is_called_edited(rigs):
    """Issue 47: nvidia-smi on rig1 lists 1 of 2 cards (the stand-in's "lost", as after Xid 79), the PCI bus still
    shows both. status and verify name the card by its bus address with what to check; the power units, rendered
    for the two cards the PCI bus shows, are not "edited by hand"."""
    rig1 = rigs.rig("rig1")
    sim = rig1.rootfs / "var/lib/rigforge-sim/state.json"
    before = sim.read_text() if sim.exists() else None
    sim.parent.mkdir(parents=True, exist_ok=True)
    sim.write_text(json.dumps({**json.loads(before or "{}"), "lost": [1]}))
    try:
        code, rows = status_json(rigs.inventory)
        report_code, report = verify_json(rigs.inventory)
    finally:
        if before is None:
            sim.unlink()
        else:
            sim.write_text(before)
    assert code == 0 and report_code == 1
    checks = checks_of(report, "rig1")
    visible = checks["GPUs visible"]
    assert visible["status"] == "fail", visible
    assert visible["detail"] == (
        "nvidia-smi shows 1 GPU(s); the PCI bus shows 2: GPU 1 (PCI 0000:02:00.0, 10de:2204, GeForce RTX 3090) "
        "is on the bus but nvidia-smi does not list it (fallen off the bus?): check its power cables and seating, and "
        "the kernel's Xid lines (`journalctl -k | grep -i xid`)"
    )
    assert checks["files as rendered"]["status"] == "pass", checks["files as rendered"]
    assert not any("edited by hand" in line for line in rows["rig1"]["pin_drift"] or []), rows["rig1"]["pin_drift"]
    assert verify_json(rigs.inventory)[0] == 0  # the card back: passes again


@pytest.mark.testbed
@pytest.mark.parametrize(
    "path",
    [
        "/opt/rigforge/serve/dual-turbo/docker-compose.yml",
        "/opt/rigforge/serve/dual-turbo/.env",
        "/etc/systemd/system/rigforge-vllm@.service",
        "/etc/systemd/system/rigforge-gpu-power.service",
        "/etc/systemd/system/rigforge-gpu-settle.service",
        "/usr/local/lib/rigforge/rigforge-gpu-settle",
        "/etc/systemd/system/rigforge-gpu-hold.service",
        "/etc/systemd/system/rigforge-gpu-hold.timer",
        "/usr/local/lib/rigforge/rigforge-gpu-hold",
    ],
)
def test_a_hand_edited_file_is_drift_in_status_and_fails_verify(rigs, path):
    """Files rigforge renders are compared whole with what the plan renders (.env by hash, never shown). A hand
    edit is drift of its own ("files as rendered"), not pin drift: the PINS column stays ok."""
    rig1 = rigs.rig("rig1")
    rig1.run(f"cp -p {path} /tmp/hand-edit.bak && echo '# edited by hand' >> {path}", check=True)
    try:
        code, rows = status_json(rigs.inventory)
        table = rigforge("status", rigs.inventory).stdout
        report_code, report = verify_json(rigs.inventory)
    finally:
        rig1.run(f"mv -f /tmp/hand-edit.bak {path}", check=True)
    assert code == 0
    edited = f"{path} differs from what rigforge renders (edited on the rig? the deploy rewrites it)"
    assert rows["rig1"]["pin_drift"] == [] and rows["rig2"]["pin_drift"] == []
    failed = [c for c in rows["rig1"]["checks"] if c["status"] == "fail"]
    assert [(c["name"], c["detail"]) for c in failed] == [("files as rendered", edited)]
    rows_shown = [line.split()[:3] for line in table.splitlines()[1:3]]
    assert rows_shown == [["rig1", "dual-turbo", "ok"], ["rig2", "dual-turbo", "ok"]]
    assert f"rig1: DRIFT files as rendered: {edited}" in table.splitlines()
    assert "DRIFT (" not in table and "pin drift" not in table
    assert report_code == 1
    failed = [c for c in report["hosts"]["rig1"]["checks"] if c["status"] == "fail"]
    assert [c["name"] for c in failed] == ["files as rendered"] and path in failed[0]["detail"]
    assert "HF_TOKEN" not in json.dumps(report) and "HF_TOKEN" not in json.dumps(rows)
    assert verify_json(rigs.inventory)[0] == 0  # put back: passes again


@pytest.mark.testbed
def test_lock_moved_ahead_of_the_rigs_shows_pin_drift(rigs, tmp_path):
    """The lock was bumped (a new genesis commit) but the rigs were not redeployed yet."""
    lock = yaml.safe_load(rigs.lock.read_text())
    newer = "1" * 40
    lock["git"]["genesis"]["commit"] = newer
    lock["git"]["genesis"]["ref"] = newer[:7]
    (tmp_path / "bumped.lock.yaml").write_text(yaml.safe_dump(lock, sort_keys=False))
    moved = [(n, {**d, "rigforge_lock": str(tmp_path / "bumped.lock.yaml")}) for n, d in inventory_rigs(rigs.inventory)]
    inv = write_inventory(tmp_path / "bumped.py", moved)
    code, rows = status_json(inv)
    assert code == 0
    for row in rows.values():
        assert row["pin_drift"] == [f"git genesis: rig {rigs.git_commits['genesis'][-1][:12]}, lock {newer[:12]}"]
    table = rigforge("status", inv).stdout
    assert "DRIFT (1)" in table and "rig1: pin drift: git genesis" in table
    code, report = verify_json(inv)
    assert code == 1
    assert f"lock {newer[:12]}" in checks_of(report, "rig1")["sources at locked SHAs"]["detail"]


# ---------------------------------------------------------------- unreachable, services managed


@pytest.mark.testbed
def test_unreachable_rig_is_a_row_with_the_error(rigs, tmp_path):
    hosts = inventory_rigs(rigs.inventory)
    gone = ("rig-gone", {**hosts[0][1], "ssh_port": free_port()})  # nothing listens there
    nosudo = ("rig-nosudo", {**hosts[1][1], "_sudo_user": "nosuchuser"})  # reachable, but sudo fails
    inv = write_inventory(tmp_path / "with_gone.py", [*hosts, gone, nosudo])
    code, rows = status_json(inv)
    assert code == 1
    assert "cannot connect" in rows["rig-gone"]["error"]
    assert "cannot run commands with sudo (sudo: unknown user nosuchuser" in rows["rig-nosudo"]["error"]
    assert rows["rig1"]["error"] is None and rows["rig2"]["error"] is None
    table = rigforge("status", inv).stdout.splitlines()
    assert any(line.startswith("rig-gone") and "ERROR: cannot connect" in line for line in table)
    assert sum(line.startswith(("rig1 ", "rig2 ")) for line in table) == 2

    code, report = verify_json(inv)
    assert code == 2  # nothing failed, but one rig could not be checked
    assert "cannot connect" in report["hosts"]["rig-gone"]["error"]
    text = rigforge("verify", inv).stdout.splitlines()
    assert any(line.split()[:4] == ["rig-gone", "ERROR", "cannot", "connect:"] for line in text)
    assert "no check failed on the rigs checked; could not check rig-gone, rig-nosudo" in text[-1]


@pytest.mark.testbed
def test_api_checks_run_from_the_rig_when_services_are_managed(rigs, tmp_path):
    """rig2 marked as managing services, its port served by the OpenAI stub on loopback: the API checks run
    from inside the rig with curl and pass; `unit active` fails, truthfully: no systemd runs in a chroot."""
    port = free_port()
    stub = subprocess.Popen(
        [sys.executable, "-m", "rigforge.testbed.openai_stub", "--port", str(port), "--ttft-ms", "1", "--dt-ms", "1"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert stub.stdout.readline().strip() == f"http://127.0.0.1:{port}"
        hosts = dict(inventory_rigs(rigs.inventory))
        managed = {**hosts["rig2"], "rigforge_manage_services": True, "serving_port": port}
        inv = write_inventory(tmp_path / "managed.py", [("rig2", managed)])
        code, report = verify_json(inv)
        _, rows = status_json(inv)
    finally:
        stub.terminate()
        stub.wait(timeout=10)
    checks = checks_of(report, "rig2")
    assert checks["/v1/models answers"]["status"] == "pass", checks
    assert "qwen3.6-27b-autoround" in checks["/v1/models answers"]["detail"]
    assert checks["chat returns text"]["status"] == "pass" and "Paris" in checks["chat returns text"]["detail"]
    assert (checks["tool call returned"]["status"], checks["tool call returned"]["detail"]) == (
        "pass",
        "tool_calls: get_weather",
    )
    assert checks["unit active"]["status"] == "fail"
    assert code == 1
    assert rows["rig2"]["api"]["reachable"] is True and rows["rig2"]["api"]["models"] == ["qwen3.6-27b-autoround"]


@pytest.mark.testbed
def test_api_checks_fail_when_nothing_answers(rigs, tmp_path):
    hosts = dict(inventory_rigs(rigs.inventory))
    managed = {**hosts["rig1"], "rigforge_manage_services": True, "serving_port": free_port()}
    code, report = verify_json(write_inventory(tmp_path / "silent.py", [("rig1", managed)]))
    checks = checks_of(report, "rig1")
    assert code == 1
    assert checks["/v1/models answers"]["status"] == "fail" and "no answer" in checks["/v1/models answers"]["detail"]
    assert checks["chat returns text"]["detail"] == "the API does not answer"


@pytest.mark.testbed
def test_unprovisioned_rig_fails_verify_and_shows_in_status(testbed_factory):
    """A fresh rig (no driver, no rig.json): every hardware/layout check fails with what to do."""
    from rigforge.testbed import RigSpec

    tb = testbed_factory([RigSpec(gpus=1)], name="opsfresh")
    code, report = verify_json(tb.inventory)
    assert code == 1
    checks = checks_of(report, "rig1")
    assert "not provisioned by rigforge (run the deploy)" in checks["manifest present"]["detail"]
    assert "nvidia-kernel-open-dkms is not installed" in checks["driver module = package"]["detail"]
    assert [n for n, c in checks.items() if c["status"] == "skip"] == SERVICE_CHECKS
    assert checks["boot order has no cycle"]["status"] == "pass"  # no unit of rigforge's yet: none in a cycle
    others = [*SERVICE_CHECKS, "boot order has no cycle"]
    assert all(c["status"] == "fail" for n, c in checks.items() if n not in others), checks
    code, rows = status_json(tb.inventory)
    assert code == 0
    assert (rows["rig1"]["variant"], rows["rig1"]["manifest"], rows["rig1"]["gpus"]) == (None, False, [])


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("cmd", ["status", "verify"])
def test_missing_inventory_exits_2_with_a_clear_message(cmd, tmp_path):
    r = rigforge(cmd, tmp_path / "nope.py")
    assert r.returncode == 2
    assert r.stdout == ""
    assert r.stderr.startswith(f"rigforge {cmd}: ") and "no such inventory file" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.testbed
def test_dirty_checkout_and_touched_weight_file_show_as_drift_in_status(rigs):
    """Status agrees with verify: a dirty checkout and a weight file changed since its stamp are drift, each under its
    own failed check (no pin moved: the PINS column stays ok)."""
    rig1 = rigs.rig("rig1")
    weights = "/opt/rigforge/models/qwen3.6-27b-autoround-int4/config.json"
    rig1.run(f"touch -r {weights} /tmp/mtime-ref && touch -d '2020-01-01' {weights}", check=True)
    rig1.run("echo local > /opt/rigforge/src/genesis/NOTES.txt", check=True)
    try:
        _, rows = status_json(rigs.inventory)
        table = rigforge("status", rigs.inventory).stdout
        code, report = verify_json(rigs.inventory)
    finally:
        rig1.run(f"rm /opt/rigforge/src/genesis/NOTES.txt && touch -r /tmp/mtime-ref {weights}", check=True)
    dirty = "git genesis: dirty checkout at /opt/rigforge/src/genesis (1 file(s), e.g. ?? NOTES.txt)"
    touched = "hf autoround-int4: config.json modified since it was verified (mtime differs from the stamp)"
    assert rows["rig1"]["pin_drift"] == [] and rows["rig2"]["pin_drift"] == []
    failed = {c["name"]: c["detail"] for c in rows["rig1"]["checks"] if c["status"] == "fail"}
    assert failed["sources at locked SHAs"].startswith(dirty) and failed["weights stamp valid"].startswith(touched)
    assert (
        f"rig1: DRIFT sources at locked SHAs: {dirty}" in table
        and f"rig1: DRIFT weights stamp valid: {touched}" in table
    )
    assert code == 1 and "modified since it was verified" in checks_of(report, "rig1")["weights stamp valid"]["detail"]
    assert checks_of(report, "rig1")["sources at locked SHAs"]["status"] == "fail"
    _, rows = status_json(rigs.inventory)  # put back: ok again
    after = {c["name"]: c["status"] for c in rows["rig1"]["checks"]}
    assert after["sources at locked SHAs"] == after["weights stamp valid"] == "pass"


def test_status_names_the_rigs_that_run_a_rollouts_candidate(tmp_path):
    """While `rigforge rollout` runs (or after it stopped midway) its marker sits beside the lock in use: status says
    which rigs run the candidate, from the pins each rig's manifest records; without the marker, nothing."""
    from types import SimpleNamespace

    import yaml

    from rigforge.cli.status import ROLLOUT_MARKER, candidate_of

    lock, candidate = tmp_path / "lock.yaml", tmp_path / "lock-b.yaml"
    image = {"ref": "vllm/vllm-openai:v0.31.0", "digest": "sha256:" + "b1" * 32}
    git = {"recipes": {"url": "git://127.0.0.1/recipes.git", "ref": "B", "commit": "b" * 40}}
    candidate.write_text(yaml.safe_dump({"version": 1, "image": image, "git": git, "hf": {}}))

    def rig(image: str, commit: str):
        pins = {"image": image, "git": {"recipes": commit}, "hf": {}}
        return SimpleNamespace(data={"rigforge_lock": str(lock)}, manifest_pins=lambda: pins)

    at_b, at_a = rig(f"vllm/vllm-openai:v0.31.0@{image['digest']}", "b" * 40), rig("vllm/vllm-openai:v0.27.1", "a" * 40)
    assert candidate_of(at_b) is None  # no rollout in progress
    (tmp_path / f"lock.yaml{ROLLOUT_MARKER}").write_text(f'{{"candidate": "{candidate}"}}')
    assert candidate_of(at_b) == {"lock": str(candidate), "runs": True}
    assert candidate_of(at_a) == {"lock": str(candidate), "runs": False}


# ---------------------------------------------------------------- a rest given with --data


@pytest.mark.testbed
def test_a_rest_given_at_deploy_is_read_from_the_rigs_own_record(rigs):
    """`serving_rest: stopped` given as --data (as `rigforge rollout` keeps a rig): the inventory file does not say
    it, rig.json does. status and verify read it there: the unit disabled on purpose, not drift."""
    pyinfra = str(Path(sys.executable).with_name("pyinfra"))
    deploy = [pyinfra, "-y", str(rigs.inventory), "deploy/dual_turbo.py", "--limit", "rig1"]
    rested = subprocess.run([*deploy, "--data", "serving_rest=stopped"], cwd=REPO, capture_output=True, text=True)
    try:
        assert rested.returncode == 0, rested.stdout[-3000:] + rested.stderr[-3000:]
        record = json.loads(rigs.rig("rig1").run("cat /etc/rigforge/rig.json", check=True).stdout)
        assert record["serving_rest"] == "stopped"
        code, report = verify_json(rigs.inventory)
        text = rigforge("verify", rigs.inventory).stdout.splitlines()
        _, rows = status_json(rigs.inventory)
        table = rigforge("status", rigs.inventory).stdout.splitlines()
    finally:
        lifted = subprocess.run(deploy, cwd=REPO, capture_output=True, text=True)
    assert code == 0, report
    unit = "rigforge-vllm@dual-turbo.service"
    enabled = checks_of(report, "rig1")["unit enabled"]
    assert (enabled["status"], enabled["detail"]) == ("pass", f"{unit} disabled on purpose (serving_rest: stopped)")
    assert checks_of(report, "rig2")["unit enabled"]["detail"] == f"{unit} enabled"
    assert text[-1] == "2 rig(s): all checks passed; skipped on rig1, rig2: services not managed on this host"
    assert rows["rig1"]["rest"] == "stopped" and rows["rig2"]["rest"] is None
    assert rows["rig1"]["service"]["rest"] == "stopped"
    assert (
        "rig1: resting stopped on purpose (/etc/rigforge/rig.json records serving_rest: stopped, from the last "
        "deploy): intended, not drift"
    ) in table
    assert lifted.returncode == 0, lifted.stdout[-3000:] + lifted.stderr[-3000:]  # lifted: served again
    assert "serving_rest" not in json.loads(rigs.rig("rig1").run("cat /etc/rigforge/rig.json", check=True).stdout)
    assert checks_of(verify_json(rigs.inventory)[1], "rig1")["unit enabled"]["detail"] == f"{unit} enabled"
