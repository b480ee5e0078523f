"""A pulled cable costs seconds, and a rig cut off from the network still boots into serving (issue 49), on the
session's booted fleet (conftest's booted_fleet: 3 rigs, 4 once test_booted_fleet has added its fourth, and the
gateway host, Debian's HAProxy with rigforge's config, default check settings), taken on as test_booted_fleet left
it and converged to dual-turbo, shared by the module's tests in order:

- under streaming load (8 clients on keep-alive connections, each its own prompt: the same under least connections
  or prefix affinity), the LAN cable of the rig serving the most streams is pulled (its bridge port down: no
  carrier). No request waits more than 8 s after the cut, those sent during detection on an already-open
  connection included; only streams that rig was sending may fail. Plugged back, the rig is UP and takes requests;
- the last rig is rebooted with its cable out and the testbed's stand-ins (hub, registry, apt, HF, the fleet
  registry) refused to it: within 3 minutes of boot its caps are set and vLLM serves from what it holds; plugged
  back, it rejoins;
- the same again with a wait for the network on the rig (systemd-networkd-wait-online, its timeout shortened):
  Docker starts once the wait gives up, vLLM after it, within 3 minutes of boot.

The module takes the fleet down when it ends.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import pytest
import requests
from support import REPO, pyinfra_run, why

pytestmark = [pytest.mark.testbed, pytest.mark.booted]
MODEL = "qwen3.6-27b-autoround"
DEPLOY = REPO / "deploy" / "dual_turbo.py"
SERVING_PORT = 8011  # dual-turbo's port on a rig
ADMIN = "/run/haproxy/rigforge-admin.sock"
STALL_LIMIT_S = 8.0  # issue 49: no request waits longer than this after the cut
CABLE_OUT_S = 12.0  # how long the cable stays out under load


@pytest.fixture(scope="module")
def fleet(booted_fleet, testbed_factory):
    """The session's booted fleet, every rig serving dual-turbo behind the gateway host (a converge: none to do
    when test_booted_fleet left it so); taken down when the module ends."""
    results, err = pyinfra_run(booted_fleet.inventory, DEPLOY)
    assert results["failed_hosts"] == [] and results["totals"]["error"] == 0, why(results, err)
    yield booted_fleet
    testbed_factory.release(booted_fleet)


def servers(tb) -> dict[str, dict[str, str]]:
    """Each rig's row of HAProxy's `show stat` on the gateway host (status, scur, hrsp_2xx, wretr, ...)."""
    out = tb.gateway.run(f"echo 'show stat' | socat stdio UNIX-CONNECT:{ADMIN}").stdout
    lines = out.splitlines()
    header = lines[0].lstrip("# ").split(",") if lines else []
    rows = [dict(zip(header, line.split(","), strict=False)) for line in lines[1:] if line]
    return {r["svname"]: r for r in rows if r.get("svname") not in ("FRONTEND", "BACKEND", None)}


def rig_names(tb) -> list[str]:
    """The fleet's rigs (the gateway's servers), in inventory order."""
    return [rig.name for rig in tb.rigs]


def wait_until(what: str, check, timeout: float, every: float = 0.2) -> float:
    """Poll `check()` until it is true; the monotonic time it first was. Fails naming `what`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return time.monotonic()
        time.sleep(every)
    raise AssertionError(f"{what}: not within {timeout:.0f}s")


@dataclass
class Request:
    """One streamed completion: when it was sent, when each piece of it arrived, how it ended."""

    start: float
    reused: bool  # sent on a connection to the gateway that an earlier request had opened
    events: list[float] = field(default_factory=list)  # the response head, then each line of the stream
    end: float = 0.0
    ok: bool = False
    why: str = ""

    def longest_wait_after(self, t: float) -> float:
        """The longest time after `t` this request went without a byte (to its end), 0 if it ended before `t`."""
        if self.end <= t:
            return 0.0
        marks = [max(self.start, t), *(e for e in self.events if e > t), self.end]
        return max(b - a for a, b in zip(marks, marks[1:], strict=False))


def taking_requests(tb, rig: str, timeout: float) -> float:
    """Short chat completions through the gateway, each its own conversation (its own first message: under prefix
    affinity each has its own place on the hash ring, so every rig is some conversation's home), one after another
    until `rig` answers one; the monotonic time it did. The load's own streams are no measure: each is a fixed few
    conversations, mid-answer for many seconds, and the ring may give `rig` none of them. Fails naming `rig`, or the
    first probe the gateway did not answer with 200."""
    served = int(servers(tb)[rig]["hrsp_2xx"])
    deadline = time.monotonic() + timeout
    n = 0
    while time.monotonic() < deadline:
        n += 1
        body = {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": f"probe {n} for {rig}"}]}
        answer = requests.post(f"{tb.gateway_url}/v1/chat/completions", json=body, timeout=30)
        assert answer.status_code == 200, (n, answer.status_code, answer.text[:300])
        if int(servers(tb)[rig]["hrsp_2xx"]) > served:
            return time.monotonic()
    raise AssertionError(f"{rig} taking requests: none of {n} conversations reached it within {timeout:.0f}s")


class Streams:
    """`clients` threads, each with its own prompt on its own keep-alive connection to the gateway, streaming
    chat completions back to back (no retries: a failed request is counted, and the next one opens a new
    connection)."""

    def __init__(self, url: str, clients: int = 8, max_tokens: int = 300):
        parts = urlsplit(url)
        self.host, self.port, self.max_tokens = parts.hostname, parts.port, max_tokens
        self.requests: list[Request] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]

    def _client(self, i: int) -> None:
        """Client `i`: its own prompt (its own prefix: any balance policy spreads the clients over the rigs)."""
        prompt = f"client {i}: count to {self.max_tokens}, one number a line, and say nothing else."
        body = json.dumps(
            {
                "model": MODEL,
                "stream": True,
                "max_tokens": self.max_tokens,
                "messages": [{"role": "user", "content": prompt}],
            }
        )
        conn = None
        while not self.stop.is_set():
            reused = conn is not None
            if conn is None:
                conn = http.client.HTTPConnection(self.host, self.port, timeout=120)
            req = Request(time.monotonic(), reused)
            self.requests.append(req)
            try:
                conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
                resp = conn.getresponse()
                req.events.append(time.monotonic())
                if resp.status != 200:
                    resp.read()
                    req.why = f"HTTP {resp.status}"
                while resp.status == 200:
                    line = resp.readline()
                    if not line:
                        break
                    req.events.append(time.monotonic())
                    if line.strip() == b"data: [DONE]":
                        req.ok = True
                if resp.status == 200:
                    resp.read()
                    req.why = "" if req.ok else "stream cut"
            except (OSError, http.client.HTTPException) as err:
                req.why = type(err).__name__
            req.end = time.monotonic()
            if not req.ok:
                conn.close()
                conn = None

    def __enter__(self) -> Streams:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=150)


def test_a_pulled_cable_costs_seconds_and_the_rig_rejoins(fleet, testbed_report):
    from rigforge.testbed import booted

    with Streams(fleet.gateway_url) as load:
        time.sleep(5)
        before = servers(fleet)
        assert {r: row["status"] for r, row in before.items()} == dict.fromkeys(rig_names(fleet), "UP"), before
        victim = max(before, key=lambda r: int(before[r]["scur"]))
        held = int(before[victim]["scur"])
        rig = next(r for r in fleet.rigs if r.name == victim)
        t_cut = time.monotonic()
        booted.set_cable(rig.dir, plugged=False)
        t_pulled = time.monotonic()  # the cable is out by now (a request sent meanwhile may have gone to the rig)
        t_down = wait_until(f"{victim} DOWN at the gateway", lambda: servers(fleet)[victim]["status"] == "DOWN", 30)
        time.sleep(max(0.0, t_cut + CABLE_OUT_S - time.monotonic()))
        out = servers(fleet)
        t_plug = time.monotonic()
        booted.set_cable(rig.dir, plugged=True)
        t_up = wait_until(f"{victim} UP again", lambda: servers(fleet)[victim]["status"] == "UP", 30)
        t_serving = taking_requests(fleet, victim, 30)
        time.sleep(3)
    requests = list(load.requests)
    waits = sorted(((r.longest_wait_after(t_cut), r) for r in requests), key=lambda w: w[0], reverse=True)
    failed = [r for r in requests if not r.ok and r.end > 0]
    during = [r for r in requests if t_cut <= r.start < t_down]
    retried = sum(int(out[victim][k]) - int(before[victim][k]) for k in ("wretr", "wredis"))
    report = {
        "rig": victim,
        "streams_it_held": held,
        "pull_took_s": round(t_pulled - t_cut, 2),
        "down_after_cut_s": round(t_down - t_cut, 2),
        "longest_wait_after_cut_s": round(waits[0][0], 2),
        "longest_wait_of_one_sent_during_detection_s": round(max((w for w, r in waits if r in during), default=0), 2),
        "sent_during_detection": len(during),
        "of_them_on_open_connections": sum(r.reused for r in during),
        "failed": len(failed),
        "failures": sorted({r.why for r in failed}),
        "retried_or_redispatched_from_it": retried,
        "up_after_plug_s": round(t_up - t_plug, 2),
        "serving_after_plug_s": round(t_serving - t_plug, 2),
        "sent": len(requests),
    }
    testbed_report.append(f"pulled cable (the LAN port of the rig with most streams, {CABLE_OUT_S:.0f}s): {report}")
    assert held >= 1, report  # the rig taken down was serving when it went
    assert failed or retried, report  # ... and lost or handed over what it had
    assert waits[0][0] <= STALL_LIMIT_S, (report, waits[0][1])
    assert during and any(r.reused for r in during), report  # detection was exercised on open connections
    lost = [(round(r.start - t_cut, 2), r.why, len(r.events)) for r in failed]
    assert all(r.start < t_pulled and r.why == "stream cut" and r.events for r in failed), (report, lost)  # its streams
    assert all(r.ok for r in requests if r.start >= t_plug and r.end), report  # nothing fails as it rejoins
    assert t_up - t_plug < 10, report


def offline(rig, on: bool) -> None:
    """Refuse (or allow again) every stand-in the testbed's relay offers the rig (apt, git, HF, the Debian
    mirror, pip's proxy, the Docker Hub stand-in): new TCP connections to them are reset, in the rig's network
    namespace (it outlives the rig's reboots). Their addresses are read from the relays' logs (the fleet
    registry's relay too, when the fleet has one)."""
    if not on:
        rig.run("iptables -D OUTPUT -j RF-OFFLINE; iptables -F RF-OFFLINE; iptables -X RF-OFFLINE")
        return
    specs = []
    for name in ("relay.log", "registry-relay.log"):
        if (rig.dir / name).exists():
            specs += (rig.dir / name).read_text().splitlines()[0].split(": ", 1)[1].split()
    rules = ["iptables -N RF-OFFLINE", "iptables -I OUTPUT -j RF-OFFLINE"]
    for spec in specs:
        if spec.startswith("in:"):  # the controller reaching into the rig (its sshd, its API): kept
            continue
        addr, _, port = spec.removeprefix("at:").partition("=")[0].rpartition(":")
        rules.append(
            f"iptables -A RF-OFFLINE -p tcp --syn -d {addr or '127.0.0.1'} --dport {port} "
            "-j REJECT --reject-with tcp-reset"
        )
    res = rig.run(" && ".join(rules))
    assert res.returncode == 0, res.stdout + res.stderr


CAPS = "nvidia-smi --query-gpu=power.limit --format=csv,noheader,nounits"


def test_a_rig_cut_off_from_the_network_boots_into_serving_and_rejoins(fleet, testbed_report):
    from rigforge.testbed import booted
    from rigforge.testbed.upstream import RIG_ADDRESS

    rig = fleet.rigs[-1]
    caps = rig.run(CAPS).stdout.split()
    assert caps and rig.run(f"curl -sf -m 5 -o /dev/null 127.0.0.1:{SERVING_PORT}/health").returncode == 0
    offline(rig, True)
    try:
        hub = rig.run(f"curl -s -m 5 -o /dev/null https://{RIG_ADDRESS}/v2/")
        assert hub.returncode == 7, hub  # refused: no hub, no registry
        booted.set_cable(rig.dir, plugged=False)
        booted.shutdown(rig.dir)
        t_boot = time.monotonic()
        booted.boot(rig.dir, timeout=180)  # systemd reaches `running`: no unit waits on the network
        t_running = time.monotonic()
        health = f"curl -sf -m 2 -o /dev/null 127.0.0.1:{SERVING_PORT}/health"
        t_serving = wait_until(
            "vLLM serving with the cable out",
            lambda: rig.run(health).returncode == 0,
            max(1.0, t_boot + 180 - time.monotonic()),
            every=1,
        )
        chat = json.dumps({"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]})
        answer = rig.run(
            f"curl -s -m 30 -o /dev/null -w '%{{http_code}}' -H 'Content-Type: application/json' "
            f"-d '{chat}' 127.0.0.1:{SERVING_PORT}/v1/chat/completions"
        ).stdout
        power = rig.run("systemctl is-active rigforge-gpu-power.service").stdout.strip()
        booted_caps = rig.run(CAPS).stdout.split()
        link = rig.run("ip -br link show eth0").stdout  # the rig's own view (its /sys may show the machine's)
        at_gateway = servers(fleet)[rig.name]["status"]
    finally:
        offline(rig, False)
        t_plug = time.monotonic()
        booted.set_cable(rig.dir, plugged=True)
    t_up = wait_until(f"{rig.name} UP at the gateway", lambda: servers(fleet)[rig.name]["status"] == "UP", 30)
    with Streams(fleet.gateway_url, clients=4, max_tokens=20):
        t_taking = taking_requests(fleet, rig.name, 30)
    report = {
        "rig": rig.name,
        "systemd_running_after_boot_s": round(t_running - t_boot, 1),
        "serving_after_boot_s": round(t_serving - t_boot, 1),
        "caps": booted_caps,
        "up_at_gateway_after_plug_s": round(t_up - t_plug, 2),
        "taking_requests_after_plug_s": round(t_taking - t_plug, 2),
    }
    testbed_report.append(f"offline boot (cable out, stand-ins refused): {report}")
    assert "NO-CARRIER" in link, link  # it booted with no carrier: its eth0 up, the other end of the cable not
    assert at_gateway.startswith("DOWN"), at_gateway  # the gateway could not reach it meanwhile
    assert t_serving - t_boot <= 180, report
    assert answer == "200", answer
    assert power == "active" and booted_caps == caps, (power, booted_caps, caps)  # set again at boot (tmpfs)
    assert t_up - t_plug < 10, report


WAIT_ONLINE_S = 20  # the rig's wait for the network, shortened in a drop-in as docs/gateway.md advises (default 2 min)
WAIT_ONLINE = "systemd-networkd-wait-online.service"
WAIT_ONLINE_DROPIN = f"/etc/systemd/system/{WAIT_ONLINE}.d/rigforge-test.conf"


def since_boot_s(rig, unit: str, prop: str) -> float:
    """Seconds from the rig's boot (systemd's start) to `unit`'s monotonic timestamp `prop`."""
    stamps = rig.run(f"systemctl show -p UserspaceTimestampMonotonic --value; systemctl show -p {prop} --value {unit}")
    boot_us, at_us = (int(line) for line in stamps.stdout.split())
    return (at_us - boot_us) / 1e6


def test_a_rig_whose_network_manager_waits_for_a_link_serves_once_the_wait_gives_up(fleet, testbed_report):
    """What rigforge does not own (docs/gateway.md): Debian's docker.service is ordered after network-online.target.
    With systemd-networkd and its wait-online service enabled on the rig (the wait shortened to 20 s in a drop-in,
    its failure ignored so the boot is not marked degraded) and the cable out, the boot waits for the network and
    only that long: the wait gives up after 20 s, Docker starts after it, vLLM serves after Docker, within 3 minutes
    of boot, and the rig rejoins the gateway once plugged back."""
    from rigforge.testbed import booted

    rig = fleet.rigs[-1]
    wait = f"ExecStart=\\nExecStart=-/usr/lib/systemd/systemd-networkd-wait-online --timeout={WAIT_ONLINE_S}\\n"
    setup = rig.run(
        f"mkdir -p {WAIT_ONLINE_DROPIN.rsplit('/', 1)[0]} && printf '[Service]\\n{wait}' > {WAIT_ONLINE_DROPIN} && "
        f"systemctl enable systemd-networkd.service {WAIT_ONLINE}"
    )
    assert setup.returncode == 0, setup.stdout + setup.stderr
    offline(rig, True)
    try:
        booted.set_cable(rig.dir, plugged=False)
        booted.shutdown(rig.dir)
        t_boot = time.monotonic()
        booted.boot(rig.dir, timeout=180)
        health = f"curl -sf -m 2 -o /dev/null 127.0.0.1:{SERVING_PORT}/health"
        left = max(1.0, t_boot + 180 - time.monotonic())
        t_serving = wait_until("vLLM serving once the wait gave up", lambda: rig.run(health).returncode == 0, left, 1)
        waited = since_boot_s(rig, WAIT_ONLINE, "ExecMainExitTimestampMonotonic")
        docker = since_boot_s(rig, "docker.service", "ActiveEnterTimestampMonotonic")
        vllm = since_boot_s(rig, "rigforge-vllm@dual-turbo.service", "ActiveEnterTimestampMonotonic")
    finally:
        offline(rig, False)
        t_plug = time.monotonic()
        booted.set_cable(rig.dir, plugged=True)
        rig.run(f"systemctl disable {WAIT_ONLINE} systemd-networkd.service; rm -f {WAIT_ONLINE_DROPIN}")
    t_up = wait_until(f"{rig.name} UP at the gateway", lambda: servers(fleet)[rig.name]["status"] == "UP", 30)
    report = {
        "rig": rig.name,
        "wait_online_gave_up_after_boot_s": round(waited, 1),
        "docker_active_after_boot_s": round(docker, 1),
        "vllm_unit_active_after_boot_s": round(vllm, 1),
        "serving_after_boot_s": round(t_serving - t_boot, 1),
        "up_at_gateway_after_plug_s": round(t_up - t_plug, 2),
    }
    testbed_report.append(f"offline boot behind a wait for the network ({WAIT_ONLINE_S} s): {report}")
    assert WAIT_ONLINE_S - 1 <= waited <= WAIT_ONLINE_S + 15, report  # it waited for a link, and gave up
    assert waited <= docker <= vllm, report  # Docker after the wait, vLLM after Docker
    assert t_serving - t_boot <= 180, report
    assert t_up - t_plug < 10, report
