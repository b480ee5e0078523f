"""The fleet gateway for real: 3 booted rigs and a booted gateway host (`testbed up --booted --rigs 3
--gateway`), Debian's HAProxy under the gateway's own systemd, the rigs' stand-in servers ending their requests
in flight on SIGTERM. Under benchmarks/bench_rollout.py's load (8 clients through the gateway), a rolling
switch (`--serial`) of every rig to dual and back fails no request; a rig whose new variant fails its gate
rolls back and rejoins, and no request fails either. The rigs are shared by the module's tests, in order.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time

import pytest
from support import REPO, changed, errored, inventory_with, pyinfra_run

pytestmark = [pytest.mark.testbed, pytest.mark.booted]
MODEL = "qwen3.6-27b-autoround"
RIGFORGE = [sys.executable, "-m", "rigforge.cli"]


def bench():
    spec = importlib.util.spec_from_file_location("bench_rollout", REPO / "benchmarks" / "bench_rollout.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def fleet(testbed_factory, testbed_report):
    from rigforge.testbed import RigSpec

    tb = testbed_factory([RigSpec()] * 3, name="gateway", booted=True, gateway=True)
    t0 = time.monotonic()
    results, err = pyinfra_run(tb.inventory, REPO / "deploy" / "dual_turbo.py")
    testbed_report.append(f"gateway: 3 rigs + gateway converged in {time.monotonic() - t0:.0f}s")
    assert results["failed_hosts"] == [] and results["totals"]["error"] == 0, err[-6000:]
    return tb


def gateway_status(tb) -> str:
    out = subprocess.run([*RIGFORGE, "status", str(tb.inventory)], capture_output=True, text=True, timeout=300)
    return next(line for line in out.stdout.splitlines() if line.startswith("gw: gateway"))


def served_variants(tb) -> list[str]:
    return [json.loads(rig.run("cat /etc/rigforge/rig.json").stdout)["variant"] for rig in tb.rigs]


def test_the_gateway_fronts_the_fleet_and_a_second_run_changes_nothing(fleet):
    load = bench().Load(fleet.gateway_url, None, 1, 8)
    assert load._one(False)[0] and load._one(True)[0]
    assert gateway_status(fleet).endswith(f"models: {MODEL}; rig1 serving, rig2 serving, rig3 serving")
    second, err = pyinfra_run(fleet.inventory, REPO / "deploy" / "dual_turbo.py")
    assert second["failed_hosts"] == [] and changed(second) == [], changed(second)


def test_a_rolling_switch_and_back_fails_no_request(fleet, testbed_report):
    b = bench()
    with b.Load(fleet.gateway_url, None, 8, 40) as load:
        t0 = time.monotonic()
        time.sleep(15)
        t1 = time.monotonic()
        runs = b.rollout(str(fleet.inventory))
        t2 = time.monotonic()
        time.sleep(5)
        t3 = time.monotonic()
    before, during, after = (b.phase(load.results, *span) for span in ((t0, t1), (t1, t2), (t2, t3)))
    testbed_report.append(f"gateway rollout: {runs}; before {before}; during {during}; after {after}")
    assert [r["rc"] for r in runs] == [0, 0], runs
    assert (before["failed"], during["failed"], after["failed"]) == (0, 0, 0), (before, during, after)
    assert during["sent"] > 0 and during["req_per_s"] >= before["req_per_s"] * 2 / 3, (before, during)
    assert served_variants(fleet) == ["dual-turbo"] * 3


def test_a_rig_whose_new_variant_fails_its_gate_rejoins_and_no_request_fails(fleet, tmp_path):
    from rigforge.testbed.booted import BROKEN_IMAGE

    inv = inventory_with(fleet, tmp_path / "inventory.py", {"rig1": {"serving_image": BROKEN_IMAGE}})
    b = bench()
    with b.Load(fleet.gateway_url, None, 8, 40) as load:
        t0 = time.monotonic()
        results, err = pyinfra_run(inv, REPO / "deploy" / "dual.py", "--limit", "rig1")
        t1 = time.monotonic()
    assert errored(results, "rig1") or results.get("failed_hosts") == "all", err[-4000:]
    assert "rigforge health gate: rolled back" in err
    assert "rolled back to dual-turbo, which rejoined the gateway" in err, err[-4000:]
    assert b.phase(load.results, t0, t1)["failed"] == 0
    assert served_variants(fleet) == ["dual-turbo"] * 3
    deadline = time.monotonic() + 30
    while "rig1 serving" not in (line := gateway_status(fleet)) and time.monotonic() < deadline:
        time.sleep(2)
    assert line.endswith("rig1 serving, rig2 serving, rig3 serving"), line
