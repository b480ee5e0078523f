"""Prefix affinity at the gateway (docs/gateway.md "Prefix affinity"): the rendered config passes the real
`haproxy -c` under either policy, and a real HAProxy on 127.0.0.1 in front of three stand-in rigs sends every turn
of a conversation to one rig, spreads conversations, honours the session header, bounds a rig's load, and moves
only a downed rig's conversations (and moves them back when it returns)."""

from __future__ import annotations

import collections
import json
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest
from test_gateway import HAPROXY, admin, free_port, gw_data, gw_knobs, rig, running_haproxy, server_status, wait_for

from rigforge.model import gateway
from rigforge.model.knobs.gateway import Gateway, validate
from rigforge.testbed.openai_stub import Schedule, make_server

MODEL = "qwen3.6-27b-autoround"
RIGS = ("rig1", "rig2", "rig3")


def lines_of(text: str) -> list[str]:
    """The config's lines without comments or indentation."""
    return [line.split("#")[0].strip() for line in text.splitlines()]


def test_both_policies_render_and_pass_haproxy_check(tmp_path):
    rigs = [rig("rig1", "dual-turbo", 8011), rig("rig2", "dual", 8010)]
    plan, problems = gateway.build("gw", gw_knobs(), rigs)
    assert problems == [] and plan.affinity
    lines = lines_of(gateway.render(plan))
    for directive in (
        "balance hash var(txn.conversation)",
        "hash-type consistent sdbm avalanche",
        "hash-balance-factor 200",
        "http-request set-var(txn.conversation) req.hdr(X-Session-Id) if { req.hdr(X-Session-Id) -m found }",
        "server rig1 127.0.0.1:8011 weight 16 tcp-ut 2s",
    ):
        assert directive in lines, directive
    assert "balance leastconn" not in lines
    tuned, _ = gateway.build("gw", gw_knobs(gateway_hash_balance_factor=125, gateway_session_header="X-Conv"), rigs)
    lines = lines_of(gateway.render(tuned))
    assert "hash-balance-factor 125" in lines and any("req.hdr(X-Conv) -m found" in x for x in lines)
    least, _ = gateway.build("gw", gw_knobs(gateway_balance="leastconn"), rigs)
    lines = lines_of(gateway.render(least))
    assert "balance leastconn" in lines and "server rig1 127.0.0.1:8011 tcp-ut 2s" in lines
    assert not any(x.startswith(("balance hash", "hash-", "http-request set-var(txn.conversation)")) for x in lines)
    for p in (plan, tuned, least):
        cfg = tmp_path / "haproxy.cfg"
        cfg.write_text(gateway.render(p))
        check = subprocess.run([HAPROXY, "-c", "-f", str(cfg)], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
    bad = validate(
        gw_data(gateway_balance="roundrobin", gateway_hash_balance_factor=100, gateway_session_header="X Session")
    )
    assert [p.split(" must")[0] for p in bad] == [
        "gateway_balance",
        "gateway_hash_balance_factor",
        "gateway_session_header",
    ]


class Fleet:
    """Three stand-in rigs, each naming itself on its answers (X-Stub-Name), behind a real HAProxy."""

    def __init__(self, tmp_path: Path, **knobs: object) -> None:
        """The stand-ins started and the gateway's plan built with `knobs` (HAProxy is started by the test)."""
        self.servers = {name: self.start(name, 0) for name in RIGS}
        plans = [rig(name, "dual", s.server_address[1]) for name, s in self.servers.items()]
        self.port = free_port()
        data = gw_data(gateway_port=self.port, gateway_bind_address="127.0.0.1", **knobs)
        self.plan, problems = gateway.build("gw", Gateway.of(data), plans)
        assert problems == []
        self.socket = str(tmp_path / "admin.sock")  # where running_haproxy puts it

    @staticmethod
    def start(name: str, port: int) -> ThreadingHTTPServer:
        """A stand-in named `name` serving on `port` (0: a free one)."""
        server = make_server(Schedule(ttft_ms=1, dt_ms=1, tokens=2, name=name), port=port)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server

    def idle(self) -> bool:
        """HAProxy counts no request in flight on the backend: the last answer's stream has ended there too (it
        ends a moment after the client has the answer, and the load bound counts it until then)."""
        rows = admin(self.socket, "show stat").splitlines()
        header = rows[0].lstrip("# ").split(",")
        backend = next(dict(zip(header, r.split(","), strict=False)) for r in rows[1:] if ",BACKEND," in r)
        return backend["scur"] == "0"

    def send(self, messages: list[dict], session: str | None = None) -> str:
        """One chat completion through the gateway, sent once the gateway is idle: the rig that answered it."""
        wait_for(self.idle)
        body = {"messages": messages, "model": MODEL, "max_tokens": 2}
        headers = {"Content-Type": "application/json", **({"X-Session-Id": session} if session else {})}
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/chat/completions", json.dumps(body).encode(), headers
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.status == 200
            return resp.headers["X-Stub-Name"]

    def close(self) -> None:
        """Every stand-in stopped."""
        for s in self.servers.values():
            s.shutdown()
            s.server_close()


def conversation(agent: int, n: int, turns: int) -> list[list[dict]]:
    """The request of each turn of conversation `n` of agent `agent`: its system prompt, then a history that grows."""
    messages = [{"role": "system", "content": f"You are agent {agent}. " + "Follow the repository's rules. " * 60}]
    out = []
    for turn in range(turns):
        messages = [*messages, {"role": "user", "content": f"conversation {n}, turn {turn}: go on"}]
        out.append(messages)
        messages = [*messages, {"role": "assistant", "content": f"done with turn {turn} of {n}"}]
    return out


def play(fleet: Fleet, conversations: dict[int, list[list[dict]]]) -> dict[int, list[str]]:
    """Every conversation's turns, interleaved turn by turn as concurrent agents send them: the rigs each turn took."""
    rigs: dict[int, list[str]] = collections.defaultdict(list)
    for turn in range(max(len(c) for c in conversations.values())):
        for n, turns in conversations.items():
            if turn < len(turns):
                rigs[n].append(fleet.send(turns[turn]))
    return rigs


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    """Three stand-ins and the gateway's plan in front of them (affinity, the default)."""
    f = Fleet(tmp_path)
    yield f
    f.close()


def test_a_conversation_stays_on_one_rig_and_conversations_spread(fleet, tmp_path):
    conversations = {n: conversation(n % 3, n, turns=4) for n in range(12)}
    with running_haproxy(tmp_path, fleet.plan) as live:
        wait_for(lambda: all(server_status(live.admin_socket, r) == "UP" for r in RIGS))
        rigs = play(fleet, conversations)
        home = {n: taken[0] for n, taken in rigs.items()}
        assert {n: set(taken) for n, taken in rigs.items()} == {n: {home[n]} for n in rigs}  # every turn, one rig
        per_rig = collections.Counter(home.values())
        assert set(per_rig) == set(RIGS) and max(per_rig.values()) <= 7, per_rig  # 12 spread over all 3

        # a session header is the key when sent: the same session on one rig whatever the body says
        assert len({fleet.send([{"role": "user", "content": f"question {i}"}], session="s-42") for i in range(6)}) == 1
        assert len({fleet.send([{"role": "user", "content": "same"}], session=f"s-{i}") for i in range(12)}) > 1

        # a rig goes down: only its conversations move; back, they return to it
        gone = max(per_rig, key=per_rig.get)
        port = fleet.servers[gone].server_address[1]
        fleet.servers[gone].shutdown()
        fleet.servers[gone].server_close()
        wait_for(lambda: server_status(live.admin_socket, gone).startswith("DOWN"))
        down = {n: fleet.send(turns[-1]) for n, turns in conversations.items()}
        moved = {n for n in conversations if down[n] != home[n]}
        assert moved == {n for n in conversations if home[n] == gone}, (home, down)
        fleet.servers[gone] = fleet.start(gone, port)
        wait_for(lambda: server_status(live.admin_socket, gone) == "UP")
        back = {n: fleet.send(turns[-1]) for n, turns in conversations.items()}
        assert back == home


def test_least_connections_scatters_a_conversation(tmp_path):
    """The contrast that makes the test above mean something: under leastconn the turns of a conversation land on
    different rigs."""
    least = Fleet(tmp_path, gateway_balance="leastconn")
    try:
        with running_haproxy(tmp_path, least.plan) as live:
            wait_for(lambda: all(server_status(live.admin_socket, r) == "UP" for r in RIGS))
            rigs = play(least, {n: conversation(n % 3, n, turns=4) for n in range(5)})
        assert sum(len(set(taken)) > 1 for taken in rigs.values()) >= 3, rigs
    finally:
        least.close()


def test_the_load_bound_holds_a_busy_conversation_to_its_share(tmp_path):
    """Twelve streams of one session at once: the bound (200 by default: no rig above twice the average in flight)
    lets its rig take at most 8 of the 12 (HAProxy: ceil(12 x 2.00) = 24 slots, 8 a rig), the rest go on to the
    other rigs; without it all 12 would go to one."""
    servers = {name: make_server(Schedule(ttft_ms=5, dt_ms=40, tokens=20)) for name in RIGS}
    for s in servers.values():
        threading.Thread(target=s.serve_forever, daemon=True).start()
    port = free_port()
    plan, _ = gateway.build(
        "gw",
        gw_knobs(gateway_port=port, gateway_bind_address="127.0.0.1"),
        [rig(n, "dual", s.server_address[1]) for n, s in servers.items()],
    )
    results: list[int] = []

    def stream() -> None:
        """One stream of the busy session; 200 when it ended with [DONE]."""
        body = {"model": MODEL, "messages": [{"role": "user", "content": "busy"}], "stream": True, "max_tokens": 20}
        headers = {"Content-Type": "application/json", "X-Session-Id": "one-busy-session"}
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(), headers)
        with urllib.request.urlopen(req, timeout=30) as resp:
            results.append(resp.status if resp.read().rstrip().endswith(b"data: [DONE]") else 0)

    with running_haproxy(tmp_path, plan) as live:
        wait_for(lambda: all(server_status(live.admin_socket, r) == "UP" for r in RIGS))
        clients = [threading.Thread(target=stream) for _ in range(12)]
        for c in clients:
            c.start()
            time.sleep(0.01)
        for c in clients:
            c.join()
    assert results == [200] * 12
    peaks = {}
    for name, s in servers.items():
        log = s.RequestHandlerClass.schedule.log
        events = sorted([(r["recv_ns"], 1) for r in log] + [(r["done_ns"], -1) for r in log])
        running = peak = 0
        for _, step in events:
            running += step
            peak = max(peak, running)
        peaks[name] = peak
        s.shutdown()
        s.server_close()
    assert max(peaks.values()) <= 8 and sum(1 for p in peaks.values() if p > 0) >= 2, peaks
