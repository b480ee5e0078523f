"""The gateway role on a testbed host of the group `gateway`, over real SSH: Debian's haproxy installed, the
config validated by `haproxy -c` on the host and root-only, the distro's unit pointed at it; a second run
changes nothing; switching the fleet's variant moves every backend to the new port and keeps the old config as
.prev; a bad gateway knob is refused before anything changes. (No systemd in a chroot: HAProxy is configured,
not started; tests/test_gateway.py runs the same config in a real HAProxy.)"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest
from support import REPO, changed, pyinfra_run
from test_converge_refusals import SNAPSHOT

pytestmark = pytest.mark.testbed
RIGFORGE = str(Path(sys.executable).with_name("rigforge"))
CFG = "/etc/rigforge/gateway/haproxy.cfg"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def fleet(testbed_factory, tmp_path_factory):
    from rigforge.testbed import RigSpec

    tb = testbed_factory([RigSpec()], name="gateway")

    def inventory(**gw_data):
        path = tmp_path_factory.mktemp("inv") / "fleet.py"
        path.write_text(
            f"exec(open({str(tb.inventory)!r}).read())\n"
            "rigs.append(('rig9.invalid', {'rigforge_variant': 'carnice-bf16mtp'}))\n"
            f"gateway = [('gw', {{**dict(rigs)['rig1'], **{gw_data!r}}})]\n"
        )
        return path

    return tb, inventory


def run(inv, entry: str):
    return pyinfra_run(inv, REPO / "deploy" / f"{entry}.py", "--limit", "gw")


def test_bad_gateway_knob_refused_before_any_change(fleet):
    tb, inventory = fleet
    rig = tb.rig("rig1")
    before = rig.run(SNAPSHOT + "; ls -la /etc/rigforge 2>&1").stdout
    results, err = run(inventory(gateway_port="http"), "dual_turbo")
    assert results.get("failed_hosts") in ("all", ["gw"]), err[-3000:]
    assert "rigforge refused the gateway on gw:" in err and "gateway_port must be a whole number" in err, err[-3000:]
    assert "Nothing was changed on this host." in err
    assert rig.run(SNAPSHOT + "; ls -la /etc/rigforge 2>&1").stdout == before


def test_gateway_converges_is_a_noop_then_follows_a_switch(fleet):
    tb, inventory = fleet
    rig = tb.rig("rig1")
    inv = inventory(gateway_api_key="fleet-key-1")
    first, err = run(inv, "dual_turbo")
    assert first["failed_hosts"] == [], err[-4000:]
    assert "the gateway leaves rig9.invalid out" in err  # its rigforge_variant disagrees with dual_turbo
    assert rig.run(f"stat -c '%a %U' {CFG}").stdout.split() == ["600", "root"]
    assert rig.run(f"haproxy -c -q -f {CFG}").returncode == 0
    cfg = rig.run(f"cat {CFG}").stdout
    assert "server rig1 rig1:8011" in cfg and "fleet-key-1" not in cfg
    dropin = rig.run("cat /etc/systemd/system/haproxy.service.d/rigforge.conf").stdout
    assert f'Environment="CONFIG={CFG}"' in dropin

    second, err = run(inv, "dual_turbo")
    assert second["failed_hosts"] == [] and changed(second) == [], changed(second)

    switched, err = run(inv, "dual")
    assert switched["failed_hosts"] == [], err[-4000:]
    assert [op for op in changed(switched) if "gateway config" in op], changed(switched)
    assert "server rig1 rig1:8010" in rig.run(f"cat {CFG}").stdout
    assert "server rig1 rig1:8011" in rig.run(f"cat {CFG}.prev").stdout


def test_a_rig_drains_and_rejoins_over_the_gateway_hosts_own_connection(fleet, tmp_path):
    """The gateway host runs HAProxy (started by hand: no systemd in a chroot) on the converged config; a run
    limited to rig1 reaches it over its own SSH connection, drains rig1 and rejoins it at a stand-in's port,
    and the gateway's frontend then reaches the stand-in (the chroot shares the controller's loopback)."""
    from rigforge.testbed.openai_stub import Schedule, make_server

    tb, inventory = fleet
    rig = tb.rig("rig1")
    port = free_port()  # the chroot shares the controller's loopback: the API's and the exporter's ports are free ones
    inv = inventory(gateway_port=port, gateway_metrics_port=free_port(), gateway_bind_address="127.0.0.1")
    first, err = run(inv, "dual_turbo")
    assert first["failed_hosts"] == [], err[-3000:]
    stub = make_server(Schedule(ttft_ms=1, dt_ms=1, tokens=2))
    threading.Thread(target=stub.serve_forever, daemon=True).start()
    assert rig.run(f"grep -qx '    bind 127.0.0.1:{port}' {CFG}").returncode == 0, rig.run(f"cat {CFG}").stdout
    started = rig.run(f"mkdir -p /run/haproxy && haproxy -D -p /run/rigforge-test-haproxy.pid -f {CFG}")
    assert started.returncode == 0, started.stderr
    try:
        results, err = pyinfra_run(
            inv,
            REPO / "tests" / "deploys" / "gateway_drain.py",
            "--limit",
            "rig1",
            "--data",
            f"test_port={stub.server_address[1]}",
        )
        assert results["failed_hosts"] == [], err[-3000:]
        assert "drain at gateway gw: gateway: drained after 0 s" in err, err[-3000:]
        assert f"rejoin at gateway gw: gateway: rig1 serving at 127.0.0.1:{stub.server_address[1]}" in err
        body = json.dumps({"model": "qwen3.6-27b-autoround", "messages": [{"role": "user", "content": "hi"}]})
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            body.encode(),
            {"Content-Type": "application/json", "Authorization": "Bearer k"},
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert json.loads(resp.read())["model"] == "qwen3.6-27b-autoround"
        state = rig.run("cat /var/lib/haproxy/rigforge-servers.state").stdout  # what a reload starts from
        assert " rig1 127.0.0.1 " in state and f" rig1 {stub.server_address[1]} " in state, state

        status = subprocess.run([RIGFORGE, "status", str(inv)], capture_output=True, text=True, timeout=300)
        line = next(li for li in status.stdout.splitlines() if li.startswith("gw: gateway"))
        assert line.startswith(f"gw: gateway http://127.0.0.1:{port} healthy") and line.endswith(
            "; models: qwen3.6-27b-autoround; rig1 UP"
        ), status.stdout
        checks = subprocess.run([RIGFORGE, "verify", str(inv)], capture_output=True, text=True, timeout=300)
        gw_checks = [
            li.split()[:2] + [" ".join(li.split()[2:5])] for li in checks.stdout.splitlines() if li.startswith("gw ")
        ]
        assert [c[:2] for c in gw_checks] == [["gw", "PASS"]] * 3, checks.stdout  # rigs up, models, chat
        assert "gateway chat: qwen3.6-27b-autoround" in checks.stdout
    finally:
        rig.run("kill $(cat /run/rigforge-test-haproxy.pid)")
        stub.shutdown()
