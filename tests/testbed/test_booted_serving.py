"""What runs is part of the declared state (issue 29), on one booted rig behind a booted gateway host, shared by
the module's tests in order (each starts from the state the one before left, and says so):

- a stopped unit: status and verify say so, one re-run starts it and gates it, the next changes nothing;
- status and verify agree on every check, on a matrix of rig states (clean with a digest-pinned lock, unit
  stopped, a compose file edited by hand onto another image, drained at the gateway, caps overwritten);
- a rig drained at the gateway and left there rejoins on the next run;
- resting on purpose (host data serving_rest: drained, then stopped) stays so through a re-run, and status
  calls it intended;
- a unit that keeps failing fails the run fast, with the journal's end, and stays drained;
- a switch cut by SIGINT or SIGTERM at three points (the drain, the restart, the health gate): the next run
  leaves the rig serving and back in the gateway.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import REPO, changed, errored, inventory_with, pyinfra_run

pytestmark = [pytest.mark.testbed, pytest.mark.booted]
RIGFORGE = [sys.executable, "-m", "rigforge.cli"]
PYINFRA = str(Path(sys.executable).with_name("pyinfra"))
DUAL, TURBO = "rigforge-vllm@dual.service", "rigforge-vllm@dual-turbo.service"
DUAL_PORT, TURBO_PORT = 8010, 8011
ADMIN = "/run/haproxy/rigforge-admin.sock"


@pytest.fixture(scope="module")
def tb(serving_fleet):
    return serving_fleet  # shared with test_booted_serving_docker (tests/conftest.py)


def deploy(tb, tmp_path, variant="dual", **data):
    inv = inventory_with(tb, tmp_path / "inventory.py", {"rig1": data}) if data else tb.inventory
    t0 = time.monotonic()
    results, stderr = pyinfra_run(inv, REPO / "deploy" / f"{variant}.py")
    return results, stderr, time.monotonic() - t0


def converged(tb, tmp_path, variant="dual", **data):
    """Deploy until the run changes nothing (at most twice): returns the first run's changes."""
    results, stderr, _ = deploy(tb, tmp_path, variant, **data)
    assert not errored(results, "rig1"), stderr[-6000:]
    first = changed(results, "rig1")
    results, stderr, _ = deploy(tb, tmp_path, variant, **data)
    assert not errored(results, "rig1") and changed(results, "rig1") == [], (changed(results, "rig1"), stderr[-4000:])
    return first


def rigforge(tb, command: str, inventory=None) -> tuple[int, dict | list]:
    res = subprocess.run(
        [*RIGFORGE, command, str(inventory or tb.inventory), "--json"], capture_output=True, text=True, timeout=300
    )
    return res.returncode, json.loads(res.stdout)


def gateway_agrees(tb, timeout=20) -> None:
    """Wait until the gateway's health check has seen what rig1's API does now (HAProxy's op state: 2 up, 0
    down), so that two reads in a row see one state."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = sh(tb.gateway, f"echo 'show servers state' | socat stdio UNIX-CONNECT:{ADMIN}")
        row = next(r for r in map(str.split, out.splitlines()) if len(r) > 18 and r[0] != "#" and r[3] == "rig1")
        if (row[5] == "2") == api(tb.rig("rig1")):
            return
        time.sleep(0.5)


def steady(detail: str) -> str:
    """A check's detail without what moves between two reads: how long a server has been in its state, and
    HAProxy's last check of a down server (a check in progress, "* L4CON Layer4 connection problem", or its
    result, "L4CON Connection refused"): "DOWN (6 s; last check: L4CON Connection refused)" reads
    "DOWN (N s; last check: …)"."""
    return re.sub(r"\((\d+ s; )?last check: [^)]*\)", "(N s; last check: …)", detail)


def settled(rig, timeout: float = 120) -> None:
    """Waits until rig's settle stage has ended its watch (it runs for a window after a boot or a cap change; while
    it runs, a cap changed by hand is set back within a second and the checks say "still watching")."""
    deadline = time.monotonic() + timeout
    while sh(rig, "systemctl show -p SubState --value rigforge-gpu-settle.service") == "running":
        assert time.monotonic() < deadline, "the settle stage still runs"
        time.sleep(1)


def checks_of_both(tb, inventory=None) -> tuple[dict, dict]:
    """({check: status} from status, the same from verify) for rig1, on the checks both report, once the
    gateway has seen the rig's API as it is and the settle stage has ended its watch."""
    settled(tb.rig("rig1"))
    gateway_agrees(tb)
    _, rows = rigforge(tb, "status", inventory)
    _, verified = rigforge(tb, "verify", inventory)
    row = next(r for r in rows if r["host"] == "rig1")
    st = {c["name"]: (c["status"], steady(c["detail"])) for c in row["checks"]}
    ve = {c["name"]: (c["status"], steady(c["detail"])) for c in verified["hosts"]["rig1"]["checks"] if c["name"] in st}
    return st, ve


def sh(host, cmd: str) -> str:
    res = host.run(cmd)
    assert res.returncode == 0, f"{cmd}: rc={res.returncode}\n{res.stdout}{res.stderr}"
    return res.stdout.strip()


def at_gateway(tb) -> str:
    """rig1's admin state in its backend at the gateway: ready, drain or maint (HAProxy's `show servers state`)."""
    out = sh(tb.gateway, f"echo 'show servers state' | socat stdio UNIX-CONNECT:{ADMIN}")
    row = next(r for r in map(str.split, out.splitlines()) if len(r) > 18 and r[0] != "#" and r[3] == "rig1")
    admin = int(row[6])
    return "maint" if admin & 0x67 else "drain" if admin & 0x18 else "ready"


def api(rig, port=DUAL_PORT) -> bool:
    return rig.run(f"curl -sf --max-time 5 http://127.0.0.1:{port}/v1/models").returncode == 0


def wait_api(rig, port=DUAL_PORT, timeout=60) -> bool:
    deadline = time.monotonic() + timeout
    while not api(rig, port) and time.monotonic() < deadline:
        time.sleep(1)
    return api(rig, port)


def test_a_stopped_unit_is_seen_started_by_one_run_and_the_next_changes_nothing(tb, tmp_path, testbed_report):
    rig = tb.rig("rig1")
    t0 = time.monotonic()
    converged(tb, tmp_path)
    testbed_report.append(f"serving: first converge and a no-op in {time.monotonic() - t0:.0f}s")
    sh(rig, f"systemctl stop {DUAL}")
    assert not api(rig)
    st, ve = checks_of_both(tb)
    assert st["unit active"][0] == "fail" and "inactive" in st["unit active"][1], st
    assert st == ve
    results, stderr, took = deploy(tb, tmp_path)
    done = changed(results, "rig1")
    assert not errored(results, "rig1"), stderr[-6000:]
    assert f"Serve the variant with vLLM | Run {DUAL}" in " ".join(done) and any("Health gate" in o for o in done), done
    assert api(rig)
    results, stderr, _ = deploy(tb, tmp_path)
    assert changed(results, "rig1") == [], stderr[-4000:]
    testbed_report.append(f"serving: a stopped unit started and gated in {took:.0f}s")


def test_status_and_verify_agree_on_every_check_across_rig_states(tb, tmp_path):
    """From dual, serving (the test before). The testbed lock pins the image's digest."""
    rig, gw = tb.rig("rig1"), tb.gateway
    serve = "/opt/rigforge/serve/dual"
    states = {
        "clean": ("true", None),
        "unit stopped": (f"systemctl stop {DUAL}", ("unit active", "container runs the locked digest")),
        "another image, by hand": (
            f"docker commit $(docker compose --project-directory {serve} ps -q) rigforge-test/other:1 >/dev/null && "
            f"sed -i 's#image: .*#image: rigforge-test/other:1#' {serve}/docker-compose.yml && "
            f"systemctl restart {DUAL} && sleep 3",
            RUNS_AND_FILES,
        ),
        "drained": (
            f"echo 'set server m_qwen3_6_27b_autoround/rig1 state drain' | socat stdio UNIX-CONNECT:{ADMIN}",
            "serving at the gateways",
        ),
        # the cap hold would set the cap back within 15 s (test_booted_cap_hold): stopped first, so the cap stays off
        "caps overwritten": (
            "systemctl stop rigforge-gpu-hold.timer && nvidia-smi -pl 250 >/dev/null",
            ("power caps hold", "caps set last at this boot"),
        ),
    }
    for name, (breaks, fails) in states.items():
        settled(rig)
        (gw if name == "drained" else rig).run(breaks)
        st, ve = checks_of_both(tb)
        assert st == ve, (name, st, ve)
        failing = {n for n, (status, _) in st.items() if status == "fail"}
        expected = set(fails) if isinstance(fails, tuple) else {fails} - {None}
        down = {"serving at the gateways"}  # a rig whose API is down is DOWN at the gateway once it has checked
        assert expected <= failing <= expected | down, (name, failing)
        if fails:  # one run puts it back, the next changes nothing
            results, stderr, _ = deploy(tb, tmp_path)
            assert not errored(results, "rig1") and changed(results, "rig1"), (name, stderr[-4000:])
            results, stderr, _ = deploy(tb, tmp_path)
            assert changed(results, "rig1") == [], (name, changed(results, "rig1"), stderr[-4000:])
            assert at_gateway(tb) == "ready" and wait_api(rig), name


RUNS_AND_FILES = ("files as rendered", "container runs the locked digest")


def test_a_rig_resting_on_purpose_stays_so_and_status_calls_it_intended(tb, tmp_path):
    """From dual, serving and in the gateway."""
    rig = tb.rig("rig1")
    for rest in ("drained", "stopped"):
        inventory = inventory_with(tb, tmp_path / f"rest-{rest}.py", {"rig1": {"serving_rest": rest}})
        converged(tb, tmp_path, serving_rest=rest)
        assert at_gateway(tb) == "drain"
        assert api(rig) == (rest == "drained")
        assert sh(rig, f"systemctl is-enabled {DUAL} || true") == ("enabled" if rest == "drained" else "disabled")
        code, rows = rigforge(tb, "status", inventory)
        row = next(r for r in rows if r["host"] == "rig1")
        assert [c for c in row["checks"] if c["status"] == "fail"] == [], row["checks"]
        text = subprocess.run([*RIGFORGE, "status", str(inventory)], capture_output=True, text=True).stdout
        assert f"rig1: resting {rest} on purpose (host data serving_rest): intended, not drift" in text, text
        st, ve = checks_of_both(tb, inventory)
        assert st == ve
    converged(tb, tmp_path)  # the key removed: serving again, back in the gateway
    assert at_gateway(tb) == "ready" and api(rig)


def test_a_unit_that_keeps_failing_fails_the_run_fast_with_the_journal_and_stays_drained(tb, tmp_path, testbed_report):
    """From dual, serving. A drop-in rigforge does not manage makes the unit fail at every start."""
    rig = tb.rig("rig1")
    dropin = f"/etc/systemd/system/{DUAL}.d"
    sh(
        rig,
        f"mkdir -p {dropin} && printf '[Service]\\nExecStartPre=/bin/sh -c \"echo rigforge-test-crash; exit 3\"\\n'"
        f" > {dropin}/crash.conf && systemctl daemon-reload && systemctl restart {DUAL} || true",
    )
    try:
        results, stderr, took = deploy(tb, tmp_path)
        assert results.get("failed_hosts") == "all" or errored(results, "rig1"), stderr[-4000:]
        assert took < 120, f"{took:.0f}s: the gate waited for a unit that keeps failing"  # the timeout is 600 s
        assert "rigforge-test-crash" in stderr, stderr[-6000:]  # the journal's end
        assert "stays drained" in stderr, stderr[-6000:]
        assert at_gateway(tb) == "drain"
        testbed_report.append(f"serving: a failing unit failed the run in {took:.0f}s (health timeout 600 s)")
    finally:
        sh(rig, f"rm -rf {dropin} && systemctl daemon-reload")
    results, stderr, _ = deploy(tb, tmp_path)
    assert not errored(results, "rig1"), stderr[-6000:]
    assert at_gateway(tb) == "ready" and api(rig)


def cut(tb, variant: str, op: str, signum: int) -> tuple[int, str]:
    """Deploy `variant`, sending `signum` to pyinfra once it starts the operation named `op`; its exit code and the
    end of its output."""
    proc = subprocess.Popen(
        [PYINFRA, "-y", str(tb.inventory), str(REPO / "deploy" / f"{variant}.py")],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    sent, said = False, []
    for line in proc.stdout:
        said = [*said[-59:], line]
        if not sent and "Starting operation" in line and op in line:
            time.sleep(0.3)
            proc.send_signal(signum)
            sent = True
    rc = proc.wait(timeout=600)
    assert sent, f"never reached {op!r}"
    return rc, "".join(said)


def without_the_image(tb, rig) -> None:
    """The rig's unit stopped and its image removed, the stand-in upstream throttled: the next run pulls for ~15 s."""
    sh(
        rig,
        "systemctl stop 'rigforge-vllm@*' && docker image rm -f rigforge-test/other:1 >/dev/null 2>&1; "
        "docker image rm -f $(docker image ls -q vllm/vllm-openai) >/dev/null",
    )
    tb.upstream_throttle(1_000_000)


@pytest.mark.parametrize("op", ["Drain rig1", "Pull vllm/", "Run rigforge-vllm@", "Health gate"])
def test_a_switch_cut_at_any_point_is_put_back_serving_and_rejoined_by_the_next_run(tb, tmp_path, op):
    """From dual (serving) or dual-turbo: each cut switches to the other variant, with SIGINT then SIGTERM. The
    cut at the pull starts from a rig whose image is gone (and whose unit is stopped: it runs the image)."""
    rig = tb.rig("rig1")
    for signum in (signal.SIGINT, signal.SIGTERM):
        now = "dual" if api(rig, DUAL_PORT) or sh(rig, f"systemctl is-enabled {DUAL} || true") == "enabled" else ""
        other, port = ("dual_turbo", TURBO_PORT) if now == "dual" else ("dual", DUAL_PORT)
        if op.startswith("Pull"):
            without_the_image(tb, rig)
        try:
            rc, said = cut(tb, other, op, signum)
        finally:
            tb.upstream_throttle(0)
        assert rc == 128 + signum, (op, signum, rc, now, said)
        results, stderr, _ = deploy(tb, tmp_path, other)
        assert not errored(results, "rig1"), (op, signum, stderr[-6000:])
        assert wait_api(rig, port, 30), (op, signum)
        assert at_gateway(tb) == "ready", (op, signum)
        results, stderr, _ = deploy(tb, tmp_path, other)
        assert changed(results, "rig1") == [], (op, signum, changed(results, "rig1"))
