"""`status` and `verify` say where the monitor is and check, per rig, that the monitor's Prometheus scrapes it
("scraped"): every target labelled with the rig is up in Prometheus's /api/v1/targets, asked on the monitor host.

No testbed: the monitor host's answers are given (a host whose commands answer from a table), in the shape of
Prometheus's HTTP API documentation (`GET /api/v1/targets?state=active`); one test runs Debian's real `prometheus`
on 127.0.0.1 with the config rigforge renders, against the testbed's vLLM stand-in and a port where nothing listens.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import time
import urllib.request
from dataclasses import asdict

from rigforge.cli import status, verify
from rigforge.model import fleet, monitor
from rigforge.model.knobs.monitor import Monitor
from rigforge.observe import drift, hosts
from rigforge.observe.drift import Check
from rigforge.testbed.openai_stub import Schedule, make_server


def target(job: str, rig: str, address: str, health: str = "up", error: str = "") -> dict:
    """One of `activeTargets`, as Prometheus's HTTP API documents it (and as Debian's 2.42 answers)."""
    return {
        "discoveredLabels": {
            "__address__": address,
            "__metrics_path__": "/metrics",
            "__scheme__": "http",
            "job": job,
            "rig": rig,
        },
        "labels": {"instance": address, "job": job, "rig": rig},
        "scrapePool": job,
        "scrapeUrl": f"http://{address}/metrics",
        "globalUrl": f"http://{address}/metrics",
        "lastError": error,
        "lastScrape": "2026-12-03T14:02:38.946397613Z",
        "lastScrapeDuration": 0.0043,
        "health": health,
        "scrapeInterval": "15s",
        "scrapeTimeout": "10s",
    }


REFUSED = 'Get "http://10.0.0.12:8011/metrics": dial tcp 10.0.0.12:8011: connect: connection refused'
ANSWER = {
    "status": "success",
    "data": {
        "activeTargets": [
            target("node", "rig1", "10.0.0.11:9100"),
            target("vllm", "rig1", "10.0.0.11:8011"),
            target("node", "rig2", "10.0.0.12:9100"),
            target("vllm", "rig2", "10.0.0.12:8011", "down", REFUSED),
            target("node", "rig3", "10.0.0.13:9100", "unknown"),
            {
                **target("haproxy", "", "10.0.0.1:8405"),
                "labels": {"instance": "10.0.0.1:8405", "job": "haproxy", "gateway": "gw"},
            },
        ],
        "droppedTargets": [],
    },
}


class Host:
    """A host whose read-only commands answer from `answers` ({a piece of the command: its output}); records them."""

    def __init__(self, name: str, answers: dict[str, str], **data):
        self.name, self.answers, self.data, self.asked = name, answers, data, []

    def get_fact(self, cls, command):
        raw = command.get_raw_value()
        self.asked.append(raw)
        return next((out for key, out in self.answers.items() if key in raw), "")


def view(answer=ANSWER, code: int = 200) -> dict:
    host = Host("mon1", {"/api/v1/targets": json.dumps(answer) + f"\n{code}"}, ssh_hostname="10.0.0.5")
    seen = hosts.observe_monitor(host)
    assert host.asked == [
        "( curl -s -m 10 -w '\\n%{http_code}' 'http://127.0.0.1:9090/api/v1/targets?state=active' ) 2>/dev/null || true"
    ]
    return seen


def test_the_monitor_is_asked_on_its_host_and_said_where_it_is():
    seen = view()
    assert seen["url"] == "http://10.0.0.5:9090" and seen["http"] == 200 and len(seen["targets"]) == 6
    assert (
        drift.monitor_line({"mon1": seen})
        == "monitor: mon1 (http://10.0.0.5:9090): Prometheus answers, 6 targets, 4 up"
    )
    nothing = hosts.observe_monitor(Host("mon1", {}))  # curl found nothing listening: no code
    assert nothing == {"url": "http://mon1:9090", "http": 0, "targets": None}
    assert (
        drift.monitor_line({"mon1": nothing})
        == "monitor: mon1 (http://mon1:9090): Prometheus did not answer (no answer)"
    )
    assert view({"status": "error", "errorType": "bad_data", "error": "x"}, 400)["targets"] is None
    assert drift.monitor_line({}) == "monitor: no monitor in the inventory (group monitor): no rig is scraped"
    assert drift.monitor_line({"mon1": None}) == "monitor: mon1 (could not be read)"


def test_scraped_is_every_target_of_the_rig_up():
    views = {"mon1": view()}
    assert drift.monitor_check("rig1", None, views) == Check("scraped", "pass", "node up, vllm up at mon1")
    down = drift.monitor_check("rig2", None, views)
    assert down == Check("scraped", "fail", f"vllm down at mon1: {REFUSED}")
    # resting stopped on purpose: vLLM is down and that is intended, the node is still scraped
    resting = drift.monitor_check("rig2", "stopped", views)
    assert resting.status == "pass" and "vllm down: resting stopped on purpose" in resting.detail
    assert drift.monitor_check("rig2", "drained", views).status == "fail"  # drained still runs vLLM
    # not scraped yet: unknown, never up
    assert drift.monitor_check("rig3", None, views) == Check(
        "scraped", "skip", "unknown: node unknown at mon1 (not scraped yet)"
    )
    missing = drift.monitor_check("rig4", None, views)
    assert missing.status == "fail" and "not among mon1's targets" in missing.detail
    assert drift.monitor_check("rig1", None, {}) is None  # no monitor in the inventory: no check


def test_a_monitor_that_cannot_be_asked_makes_scraped_unknown():
    for views, why in (
        ({"mon1": None}, "host not read"),
        ({"mon1": view(code=503)}, "HTTP 503"),
        ({"mon1": {"url": "http://mon1:9090", "http": 0, "targets": None}}, "no answer"),
    ):
        c = drift.monitor_check("rig1", None, views)
        assert c == Check("scraped", "skip", f"unknown: the monitor mon1 could not be asked ({why})"), c


def test_status_ends_each_rigs_checks_with_scraped_and_says_where_the_monitor_is():
    def rig(name: str) -> dict:
        return {"host": name, "error": None, "rest": None, "checks": [{"name": "unit active", "status": "pass"}]}

    rows = [rig("rig1"), rig("rig2"), {"host": "mon1", "error": None, "rig": False, "rest": None, "monitor": view()}]
    rows = status.with_fleet_checks(rows, ("mon1",))
    assert rows[0]["checks"][-1] == asdict(Check("scraped", "pass", "node up, vllm up at mon1"))
    assert rows[1]["checks"][-1]["status"] == "fail"
    assert status._cells(rows[2]) == ["mon1", "the fleet monitor (no rig)"]
    assert drift.monitor_line(status.monitor_views(rows, ("mon1",))).startswith(
        "monitor: mon1 (http://10.0.0.5:9090): "
    )
    # the monitor host unreachable: its row is an error, every rig's scraped unknown
    rows = status.with_fleet_checks([rig("rig1"), {"host": "mon1", "error": "cannot connect"}], ("mon1",))
    assert rows[0]["checks"][-1]["status"] == "skip" and "could not be asked" in rows[0]["checks"][-1]["detail"]
    rows = status.with_fleet_checks([rig("rig1")], ())  # no monitor: no check
    assert [c["name"] for c in rows[0]["checks"]] == ["unit active"]


def test_verify_ends_each_rigs_checks_with_scraped():
    results = {
        "rig1": ([Check("unit active", "pass")], {"rest": None, "rig": True}),
        "rig2": ([Check("unit active", "pass")], {"rest": None, "rig": True}),
        "mon1": ([Check("prometheus answers", "pass")], {"rest": None, "rig": False, "monitor": view()}),
    }
    out = verify.with_fleet_checks(results, ("mon1",))
    assert [c.name for c in out["rig1"][0]] == ["unit active", "scraped"]
    assert out["rig2"][0][-1].status == "fail" and REFUSED in out["rig2"][0][-1].detail
    assert out["mon1"] == results["mon1"]
    assert verify.with_fleet_checks(results, ()) == results  # no monitor in the inventory: no check
    unread = verify.with_fleet_checks({**results, "mon1": OSError("cannot connect")}, ("mon1",))
    assert unread["rig1"][0][-1].status == "skip"


def test_verify_checks_that_the_monitors_prometheus_answers():
    class MonitorHost(Host):
        groups = ("monitor",)

    fl = fleet.Fleet(roles={"mon1": frozenset({fleet.MONITOR})}, plans={}, problems={})
    answers = {"/api/v1/targets": json.dumps(ANSWER) + "\n200"}
    checks, seen = verify.check_host(MonitorHost("mon1", answers), fl)
    assert checks == [Check("prometheus answers", "pass", "http://mon1:9090: 6 targets")] and seen["monitor"]
    checks, _ = verify.check_host(MonitorHost("mon1", {}), fl)
    assert checks == [Check("prometheus answers", "fail", "http://mon1:9090/api/v1/targets?state=active: no answer")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_real_prometheus_scraping_the_stand_in_answers_what_scraped_reads(tmp_path):
    """Debian's prometheus, with the prometheus.yml rigforge renders (and its rules), scrapes the testbed's vLLM
    stand-in for both rigs' vllm jobs and rig2's node job; rig1's node exporter is a port where nothing listens."""
    binary = shutil.which("prometheus")
    assert binary, "prometheus is missing: apt-get install prometheus (.ci/run installs it)"
    stub = make_server(Schedule(model="m", ttft_ms=1, dt_ms=1, tokens=3))
    threading.Thread(target=stub.serve_forever, daemon=True).start()
    up, dead, web = f"127.0.0.1:{stub.server_address[1]}", f"127.0.0.1:{free_port()}", free_port()
    targets = {"node": (("rig1", dead), ("rig2", up)), "vllm": (("rig1", up), ("rig2", up)), "haproxy": ()}
    (tmp_path / "prometheus.yml").write_text(monitor.render_config(targets, Monitor(monitor_scrape_interval_s=1)))
    (tmp_path / "rigforge-alerts.rules.yml").write_text(monitor.rules())
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{web}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{web}{monitor.TARGETS_PATH}", timeout=5) as r:
                    code, body = r.status, r.read().decode()
                found = monitor.active_targets(code, body)
                if found and len(found) == 4 and all(t["health"] != "unknown" for t in found):
                    break
            except OSError:
                pass
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "Prometheus never scraped every target"
            time.sleep(0.2)
    finally:
        proc.terminate()
        proc.wait(30)
        stub.shutdown()
        stub.server_close()
    views = {"mon1": {"url": f"http://127.0.0.1:{web}", "http": code, "targets": found}}
    assert drift.monitor_check("rig2", None, views) == Check("scraped", "pass", "node up, vllm up at mon1")
    rig1 = drift.monitor_check("rig1", None, views)
    assert (
        rig1.status == "fail" and rig1.detail.startswith("node down at mon1: ") and "connection refused" in rig1.detail
    )
