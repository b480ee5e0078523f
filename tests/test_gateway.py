"""The fleet gateway's config (rigforge/model/gateway.py): accepted by the real `haproxy -c`, refused on bad input, and
a real HAProxy on 127.0.0.1 in front of stand-in rigs routes by model, answers the healthy union on
/v1/models, checks the fleet key, sends the rigs' key on, and stops sending to a rig whose /health fails."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import http.client
import http.server
import json
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request

from rigforge.cli import status, verify
from rigforge.layout import GATEWAY_ADMIN_SOCKET, GATEWAY_STATE
from rigforge.model import gateway
from rigforge.model.fleet import plan_for
from rigforge.model.knobs.gateway import DEFAULTS, Gateway, validate
from rigforge.observe import drift, hosts, verdict
from rigforge.testbed.openai_stub import Schedule, make_server

HAPROXY = shutil.which("haproxy") or "/usr/sbin/haproxy"  # Debian's haproxy (.ci/run installs it)


def rig(name: str, variant: str, port: int, **data):
    plan, problems = plan_for(
        name,
        {"rigforge_variant": variant, "serving_port": port, "gateway_address": "127.0.0.1", **data},
        gpus=2,
        deployable=False,
    )
    assert not problems, problems
    return plan


def gw_data(**data) -> dict:
    return {**DEFAULTS, **data}


def gw_knobs(**data) -> Gateway:
    """A gateway host's knobs, typed, as the fleet gives them to gateway.build (`Fleet.knobs`)."""
    return Gateway.of(gw_data(**data))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_build_refuses_what_the_gateway_cannot_front():
    keyed = rig("rig1", "dual", 8010, serving_api_key="k1")
    _, problems = gateway.build("gw", gw_knobs(), [keyed, rig("rig2", "dual-turbo", 8011, serving_api_key="k2")])
    assert any("different serving_api_key" in p for p in problems)
    assert any("set gateway_api_key" in p for p in problems), problems
    assert gateway.build("gw", gw_knobs(), [])[1] == [
        "no rig in the inventory to put behind the gateway (hosts outside the group `gateway`)"
    ]
    plan, problems = gateway.build("gw", gw_knobs(gateway_api_key="fleet-s3cret"), [keyed])
    assert problems == [] and plan.key_hash == hashlib.sha256(b"Bearer fleet-s3cret").hexdigest().upper()
    assert "fleet-s3cret" not in gateway.render(plan) and "fleet-s3cret" not in repr(plan)


def test_config_passes_haproxy_check(tmp_path):
    rigs = [rig("rig1", "dual-turbo", 8011), rig("rig2", "dual", 8010), rig("rig3", "carnice-bf16mtp", 8070)]
    plan, problems = gateway.build("gw", gw_knobs(gateway_api_key="fleet-s3cret"), rigs)
    assert problems == []
    assert [(b.model, [s.name for s in b.servers]) for b in plan.backends] == [
        ("carnice-bf16mtp", ["rig3"]),
        ("qwen3.6-27b-autoround", ["rig1", "rig2"]),
    ]
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(gateway.render(plan))
    check = subprocess.run([HAPROXY, "-c", "-f", str(cfg)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    cfg.write_text(gateway.render(plan).replace("balance hash ", "balance nonsense "))
    assert subprocess.run([HAPROXY, "-c", "-q", "-f", str(cfg)], capture_output=True).returncode != 0


@contextlib.contextmanager
def running_haproxy(tmp_path, plan):
    """A real HAProxy in the foreground on `plan`'s config, its runtime API and state file in tmp_path."""
    plan = dataclasses.replace(plan, admin_socket=str(tmp_path / "admin.sock"), state_file=str(tmp_path / "state"))
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(gateway.render(plan))
    proc = subprocess.Popen([HAPROXY, "-db", "-f", str(cfg)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield plan
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def call(url: str, body: dict | None = None, key: str | None = "fleet-s3cret") -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url, json.dumps(body).encode() if body else None, headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")
    except urllib.error.URLError:  # not listening (yet)
        return 0, {}


def wait_for(predicate, timeout: float = 15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError("timed out")


def test_real_haproxy_routes_by_model_and_follows_health(tmp_path):
    stubs = {}
    qwen, carnice = "qwen3.6-27b-autoround", "carnice-bf16mtp"
    for name, model in (("rig1", qwen), ("rig2", qwen), ("rig3", carnice)):
        server = make_server(Schedule(model=model, api_key="rigkey", ttft_ms=1, dt_ms=1, tokens=3))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        stubs[name] = server
    variants = {"rig1": "dual-turbo", "rig2": "dual", "rig3": "carnice-bf16mtp"}
    rigs = [rig(n, variants[n], s.server_address[1], serving_api_key="rigkey") for n, s in stubs.items()]
    port = free_port()
    plan, problems = gateway.build(
        "gw", gw_knobs(gateway_port=port, gateway_bind_address="127.0.0.1", gateway_api_key="fleet-s3cret"), rigs
    )
    assert problems == []
    base = f"http://127.0.0.1:{port}"
    with running_haproxy(tmp_path, plan):
        models = lambda: sorted(m["id"] for m in call(f"{base}/v1/models")[1].get("data", []))  # noqa: E731
        assert wait_for(lambda: models() == ["carnice-bf16mtp", "qwen3.6-27b-autoround"])
        assert call(f"{base}/health", key=None)[0] == 200
        assert call(f"{base}/v1/models", key=None)[0] == 401
        assert call(f"{base}/v1/models", key="wrong")[0] == 401
        chat = {"messages": [{"role": "user", "content": "Capital of France?"}], "max_tokens": 8}
        for model in ("qwen3.6-27b-autoround", "carnice-bf16mtp"):
            status, reply = call(f"{base}/v1/chat/completions", {**chat, "model": model})
            assert status == 200 and reply["model"] == model, reply  # the rig's key was sent on
        assert call(f"{base}/v1/chat/completions", {**chat, "model": "gpt-4"})[0] == 404

        stubs["rig3"].shutdown()  # the only carnice rig goes away: it leaves the union, its model gets 503
        stubs["rig3"].server_close()
        assert wait_for(lambda: models() == ["qwen3.6-27b-autoround"])
        assert call(f"{base}/v1/chat/completions", {**chat, "model": "carnice-bf16mtp"})[0] == 503
        for _ in range(6):  # the qwen rigs still answer every request
            assert call(f"{base}/v1/chat/completions", {**chat, "model": "qwen3.6-27b-autoround"})[0] == 200
    for server in stubs.values():
        server.shutdown()


def stub(model: str = "qwen3.6-27b-autoround", dt_ms: float = 50.0, tokens: int = 30):
    server = make_server(Schedule(model=model, ttft_ms=5, dt_ms=dt_ms, tokens=tokens))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def stream(base: str, results: list, max_tokens: int = 30) -> None:
    """One streamed chat completion through the gateway; appends (status, ends with [DONE])."""
    body = {"model": "qwen3.6-27b-autoround", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    body["max_tokens"] = max_tokens
    req = urllib.request.Request(
        f"{base}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    status, complete = 0, False
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            status = resp.status
            complete = resp.read().rstrip().endswith(b"data: [DONE]")
    except urllib.error.HTTPError as err:
        status = err.code
    except (urllib.error.URLError, ConnectionError, http.client.HTTPException, ValueError):
        pass  # refused, or cut mid-stream (a truncated chunked body)
    results.append((status, complete))


def sh(script: str) -> str:
    proc = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_drain_waits_for_requests_in_flight_and_rejoin_follows_the_new_port(tmp_path):
    """A rig drained at the gateway gets no new request, its streams in flight end whole, the drain returns
    only then; rejoined at another port (a variant switch), it serves again there, and a reload keeps that."""
    old, other = stub(), stub()
    rigs = [rig("rig1", "dual-turbo", old.server_address[1]), rig("rig2", "dual", other.server_address[1])]
    port = free_port()
    plan, _ = gateway.build("gw", gw_knobs(gateway_port=port, gateway_bind_address="127.0.0.1"), rigs)
    base = f"http://127.0.0.1:{port}"
    backend = gateway.backend_name("qwen3.6-27b-autoround")
    with running_haproxy(tmp_path, plan) as live:
        assert wait_for(lambda: len(call(f"{base}/v1/models", key=None)[1].get("data", [])) == 1)
        results: list = []
        clients = [threading.Thread(target=stream, args=(base, results)) for _ in range(4)]
        for client in clients:
            client.start()
        time.sleep(0.3)  # the four 1.5 s streams are in flight, spread over both rigs
        t0 = time.monotonic()
        out = sh(on_live(live, gateway.drain_script("rig1", timeout=30)))
        drained_after = time.monotonic() - t0
        assert "others up 1" in out and "drained after" in out, out
        assert drained_after > 0.5  # it waited for rig1's streams
        in_flight = len(old.RequestHandlerClass.schedule.log)
        assert in_flight >= 1  # rig1 finished what it had, whole
        for _ in range(4):  # drained: every new request goes to rig2
            stream(base, results, max_tokens=2)
        assert len(old.RequestHandlerClass.schedule.log) == in_flight
        for client in clients:
            client.join()
        assert results == [(200, True)] * 8

        old.shutdown()  # rig1 restarts on another port, as a variant switch does
        old.server_close()
        new = stub()
        out = sh(on_live(live, gateway.rejoin_script("rig1", backend, "localhost", new.server_address[1], wait=30)))
        assert f"serving at 127.0.0.1:{new.server_address[1]}" in out, out
        for _ in range(6):
            stream(base, results, max_tokens=2)
        assert len(new.RequestHandlerClass.schedule.log) >= 1 and results[8:] == [(200, True)] * 6
        state = (tmp_path / "state").read_text()
        assert "rig1 127.0.0.1 2 " in state and f" {new.server_address[1]} " in state, state
    for server in (other, new):
        server.shutdown()


def test_stand_in_server_bounds_its_concurrency_and_ends_requests_in_flight_on_abort():
    """The testbed's serving stand-in: two completions at once on one slot take twice as long as one; abort()
    (its SIGTERM) cuts a stream before [DONE], which is why a rig must be drained before it restarts."""
    server = make_server(Schedule(ttft_ms=5, dt_ms=20, tokens=10, max_concurrent=1))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    results: list = []
    t0 = time.monotonic()
    clients = [threading.Thread(target=stream, args=(base, results, 10)) for _ in range(2)]
    for client in clients:
        client.start()
    for client in clients:
        client.join()
    assert results == [(200, True)] * 2 and time.monotonic() - t0 >= 0.35  # one after the other: 2 x 0.185 s
    cut = threading.Thread(target=stream, args=(base, results, 10))
    cut.start()
    time.sleep(0.1)
    server.abort()
    cut.join()
    assert results[2] == (200, False)  # the stream ended without [DONE]
    server.shutdown()


# ---- when a rig dies (docs/gateway.md "When a rig dies")


def test_holding_settings_are_rendered_from_the_knobs_and_haproxy_accepts_them(tmp_path):
    rigs = [rig("rig1", "dual-turbo", 8011), rig("rig2", "dual", 8010)]
    plan, problems = gateway.build("gw", gw_knobs(), rigs)
    assert problems == []
    text = gateway.render(plan)
    lines = [line.split("#")[0].strip() for line in text.splitlines()]
    for directive in (
        "tune.bufsize 1048576",
        "retries 3",
        "retry-on conn-failure empty-response junk-response response-timeout 502 503",
        "option redispatch 1",
        "option srvtcpka",
        "srvtcpka-idle 1s",
        "option httplog",
        "default-server check inter 1000ms fastinter 500ms downinter 1000ms fall 2 rise 2 observe layer7"
        " error-limit 3 on-error mark-down init-addr last,libc,192.0.2.1",
    ):
        assert directive in lines, directive
    servers = [line for line in lines if line.startswith("server ")]
    assert servers and all(line.endswith(" tcp-ut 2s") for line in servers), servers  # per server: 2.6 drops it
    knobs = {
        "gateway_retries": 2,
        "gateway_bufsize": 262144,
        "gateway_check_interval_ms": 500,
        "gateway_check_fall": 3,
        "gateway_check_rise": 1,
        "gateway_error_limit": 5,
        "gateway_keepalive_s": 3,
        "gateway_tcp_user_timeout_s": 4,
    }
    tuned, _ = gateway.build("gw", gw_knobs(**knobs), rigs)
    lines = [line.split("#")[0].strip() for line in gateway.render(tuned).splitlines()]
    assert "tune.bufsize 262144" in lines and "retries 2" in lines and "srvtcpka-idle 3s" in lines
    assert all(line.endswith(" tcp-ut 4s") for line in lines if line.startswith("server "))
    assert any(
        x.startswith(
            "default-server check inter 500ms fastinter 250ms downinter 500ms fall 3 rise 1 "
            "observe layer7 error-limit 5 on-error mark-down"
        )
        for x in lines
    )
    for p in (plan, tuned):
        cfg = tmp_path / "haproxy.cfg"
        cfg.write_text(gateway.render(p))
        check = subprocess.run([HAPROXY, "-c", "-f", str(cfg)], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
    bad = validate(gw_data(gateway_bufsize=1024, gateway_check_fall=0, gateway_retries="many"))
    assert [p.split(" must")[0] for p in bad] == ["gateway_retries", "gateway_bufsize", "gateway_check_fall"]


class DeadEngine(http.server.BaseHTTPRequestHandler):
    """A rig whose host and /health still answer but whose engine does not: a completion gets an empty response
    (the connection closed, no byte) or a 502, as from a dying vLLM behind a live host."""

    answer = "empty"

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.answer == "502":
            with contextlib.suppress(OSError):  # HAProxy may hang up first
                self.send_error(502)
        self.close_connection = True

    def log_message(self, *args):
        pass


def on_live(live, script: str) -> str:
    """A runtime-API script pointed at the test HAProxy's socket and state file (paths that need no quoting)."""
    return script.replace(GATEWAY_ADMIN_SOCKET, live.admin_socket).replace(GATEWAY_STATE, live.state_file)


def admin(sock: str, command: str) -> str:
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(sock)
        s.sendall(command.encode() + b"\n")
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out.decode()


def server_stat(sock: str, server: str) -> dict:
    """HAProxy's `show stat` row of `server` (status UP, DOWN, UP 1/2, ...; chkdown: its UP-to-DOWN transitions)
    in the first backend that has it; {} before HAProxy answers."""
    try:
        lines = admin(sock, "show stat").splitlines()
    except OSError:  # not started yet
        return {}
    header = lines[0].lstrip("# ").split(",")
    for line in lines[1:]:
        row = dict(zip(header, line.split(","), strict=False))
        if row.get("svname") == server:
            return row
    return {}


def server_status(sock: str, server: str) -> str:
    return server_stat(sock, server).get("status", "absent")


def completions(base: str, n: int, clients: int = 8, size: int = 0) -> list[int]:
    """`clients` plain HTTP clients (no retries), each with its own prompt (its own conversation under prefix
    affinity), `n` non-streamed completions each: their HTTP statuses."""
    out: list[int] = []

    def client(i: int):
        chat = {"messages": [{"role": "user", "content": f"client {i}: " + ("x" * size or "hi")}]}  # its own prompt
        for _ in range(n):
            body = {**chat, "model": "qwen3.6-27b-autoround", "max_tokens": 3}
            out.append(call(f"{base}/v1/chat/completions", body, key=None)[0])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_real_haproxy_a_dead_rig_costs_no_request_sent_after_it_died(tmp_path):
    """Three rigs; one's engine dies: refused, then empty answers, then 502s (its /health still 200). Every
    request after the death succeeds (retried on another rig at the first retry), and the refusing rig is DOWN
    within 2 s; back, it is UP within 5 s and nothing fails as it rejoins."""
    rigs_up = {name: stub(dt_ms=1, tokens=3) for name in ("rig1", "rig2", "rig3")}
    plans = [rig(n, "dual-turbo", s.server_address[1]) for n, s in rigs_up.items()]
    port = free_port()
    plan, _ = gateway.build("gw", gw_knobs(gateway_port=port, gateway_bind_address="127.0.0.1"), plans)
    base = f"http://127.0.0.1:{port}"
    with running_haproxy(tmp_path, plan) as live:
        sock = live.admin_socket
        assert wait_for(lambda: all(server_status(sock, n) == "UP" for n in rigs_up))
        assert completions(base, 3) == [200] * 24
        dead_port = rigs_up["rig3"].server_address[1]
        rigs_up["rig3"].abort()  # its connections cut (HAProxy keeps idle ones), and refused from now on
        rigs_up["rig3"].shutdown()
        rigs_up["rig3"].server_close()
        t0 = time.monotonic()
        assert completions(base, 10) == [200] * 80
        wait_for(lambda: server_status(sock, "rig3").startswith("DOWN"), timeout=5)
        assert time.monotonic() - t0 < 2.0

        for answer in ("empty", "502"):  # a live host whose engine answers nothing or 502, /health still 200
            handler = type("Dead", (DeadEngine,), {"answer": answer})
            dead = http.server.ThreadingHTTPServer(("127.0.0.1", dead_port), handler)
            threading.Thread(target=dead.serve_forever, daemon=True).start()
            wait_for(lambda: server_status(sock, "rig3") == "UP", timeout=5)
            before = server_stat(sock, "rig3")
            assert completions(base, 10) == [200] * 80, answer
            after = server_stat(sock, "rig3")
            retried = int(after["wretr"]) - int(before["wretr"])
            assert retried >= 1 and int(after["wredis"]) - int(before["wredis"]) == retried  # first retry elsewhere
            dead.shutdown()
            dead.server_close()

        back = make_server(Schedule(ttft_ms=5, dt_ms=1, tokens=3), port=dead_port)
        threading.Thread(target=back.serve_forever, daemon=True).start()
        t0 = time.monotonic()
        results: list = []
        rejoining = threading.Thread(target=lambda: results.extend(completions(base, 15)))
        rejoining.start()
        wait_for(lambda: server_status(sock, "rig3") == "UP", timeout=5)
        assert time.monotonic() - t0 < 5.0
        rejoining.join()
        assert results == [200] * 120
        served = int(server_stat(sock, "rig3")["hrsp_2xx"])
        assert completions(base, 3) == [200] * 24 and int(server_stat(sock, "rig3")["hrsp_2xx"]) > served
    for server in (rigs_up["rig1"], rigs_up["rig2"], back):
        server.shutdown()


def test_a_request_must_fit_the_buffer_to_be_routed_and_retried(tmp_path):
    """The openai client sends "messages" before "model": a body bigger than tune.bufsize (less its 1 KiB
    rewrite reserve) is routed nowhere (404). The default (1 MiB) routes a 200 KB prompt; 16 KiB (HAProxy's own
    default) does not."""
    one = stub(dt_ms=1, tokens=3)
    plans = [rig("rig1", "dual-turbo", one.server_address[1])]
    chat = {"messages": [{"role": "user", "content": "x" * 200_000}], "model": "qwen3.6-27b-autoround"}
    for bufsize, want in ((None, 200), (16384, 404)):
        port = free_port()
        knobs = {"gateway_bufsize": bufsize} if bufsize else {}
        plan, _ = gateway.build("gw", gw_knobs(gateway_port=port, gateway_bind_address="127.0.0.1", **knobs), plans)
        (tmp_path / str(port)).mkdir()
        with running_haproxy(tmp_path / str(port), plan) as live:
            assert wait_for(lambda: server_status(live.admin_socket, "rig1") == "UP")  # noqa: B023
            assert call(f"http://127.0.0.1:{port}/v1/chat/completions", chat, key=None)[0] == want, bufsize
    one.shutdown()


def test_status_verify_and_the_deploy_read_each_rigs_state_and_a_down_rigs_last_check(tmp_path):
    """hosts.gateway_servers on a real HAProxy's `show servers state` and `show stat` (what
    gateway.read_servers_script prints): UP, DRAIN, MAINT, a moved port, and a DOWN rig with its last check's error;
    verify's "gateway rigs up" fails naming it, status's line shows every rig in the same words, and
    verdict.gateway_server (the deploy's rejoin and drain decide with it) lists what differs per rig."""
    one = stub(dt_ms=1, tokens=3)
    up = one.server_address[1]
    plans = [
        rig("rig1", "dual-turbo", up),
        rig("rig2", "dual-turbo", free_port()),
        rig("rig3", "dual", up),
        rig("rig4", "dual", up),
        rig("rig5", "dual", up),
    ]
    port = free_port()
    plan, _ = gateway.build("gw", gw_knobs(gateway_port=port, gateway_bind_address="127.0.0.1"), plans)
    backend = gateway.backend_name("qwen3.6-27b-autoround")
    with running_haproxy(tmp_path, plan) as live:
        sock = live.admin_socket
        assert wait_for(lambda: server_status(sock, "rig2").startswith("DOWN"))
        admin(sock, f"set server {backend}/rig3 state drain")
        admin(sock, f"set server {backend}/rig4 state maint")
        admin(sock, f"set server {backend}/rig5 addr 127.0.0.1 port {up + 1}")
        answer = admin(sock, "show servers state") + f"\n{gateway.STAT_MARK}\n" + admin(sock, "show stat")
    one.shutdown()
    servers = hosts.gateway_servers(answer)
    rigs = {name: hosts.rig_at_gateway(by_backend) for name, by_backend in servers.items()}
    assert rigs["rig1"] == "UP" and rigs["rig3"] == "DRAIN" and rigs["rig4"] == "MAINT", rigs
    assert re.fullmatch(r"DOWN \(\d+ s; last check: L4CON Connection refused\)", rigs["rig2"]), rigs
    assert servers["rig1"][backend]["port"] == up and servers["rig5"][backend]["port"] == up + 1
    assert verdict.gateway_server(servers["rig1"], backend, up, None) == []
    assert verdict.gateway_server(servers["rig3"], backend, up, None) == ["DRAIN, declared serving"]
    assert verdict.gateway_server(servers["rig3"], backend, up, "drained") == []
    assert verdict.gateway_server(servers["rig4"], backend, up, "drained") == []
    assert (
        verdict.gateway_server(servers["rig5"], backend, up, None)[0]
        == f"sent to port {up + 1}, the rig serves on {up}"
    )
    assert verdict.gateway_server(servers["rig2"], backend, up, None)[-1].startswith("DOWN (")
    view = {"url": "http://gw:8088", "unit": "active", "health": 200, "models_http": 0, "models": None, "rigs": rigs}
    checks = verify.gateway_checks(None, {}, view)
    assert (checks[0].name, checks[0].status) == ("gateway rigs up", drift.FAIL)
    assert checks[0].detail.startswith("rig2 DOWN (") and "L4CON Connection refused" in checks[0].detail
    [line] = [f"gw: {n}" for n in status.notes({"host": "gw", "gateway": view})]
    assert "rig1 UP, rig2 DOWN (" in line and line.endswith("rig3 DRAIN, rig4 MAINT, rig5 UP"), line
    fine = {**view, "rigs": {"rig1": "UP", "rig3": "DRAIN"}}
    assert verify.gateway_checks(None, {}, fine)[0].status == drift.PASS
    assert hosts.gateway_servers("") == {}


def test_bench_rollout_rig_death_mode_times_down_and_up_from_show_stat(tmp_path):
    """benchmarks/bench_rollout.py --rig-death: after KILL, STAT is polled until the rig is DOWN, then UP."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_rollout.py"
    spec = importlib.util.spec_from_file_location("bench_rollout", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    states = tmp_path / "states"
    states.write_text("UP\nDOWN\nDOWN\nUP\n")
    stat = (
        f"echo '# pxname,svname,status'; echo \"m,rig2,$(head -1 {states})\"; "
        f"sed -i 1d {states}; [ -s {states} ] || echo UP > {states}"
    )
    load = bench.Load("http://127.0.0.1:9", None, 0, 1)
    report = bench.rig_death(load, "rig2", "true", stat, settle=0, wait=10)
    assert report["down_after_s"] is not None and report["up_after_s"] > report["down_after_s"], report
    assert report["after_kill"]["failed"] == 0
    assert bench.server_status("# pxname,svname,status\nm,rig1,UP\nm,rig2,DOWN 1/2\n", "rig2") == "DOWN 1/2"


def test_haproxys_prometheus_exporter_answers_on_its_own_port_only(tmp_path):
    """The exporter frontend passes `haproxy -c`; a real HAProxy serves /metrics there (each rig's server state
    per backend) and not on the API's port; the two ports must differ."""
    rigs = [rig("rig1", "dual-turbo", free_port()), rig("rig2", "dual", free_port())]
    plan, problems = gateway.build("gw", gw_knobs(gateway_port=free_port()), rigs)
    assert problems == [] and plan.metrics_bind == ":8405"
    assert "http-request use-service prometheus-exporter if { path /metrics }" in gateway.render(plan)
    cfg = tmp_path / "check.cfg"
    cfg.write_text(gateway.render(plan))
    check = subprocess.run([HAPROXY, "-c", "-f", str(cfg)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    api, metrics = free_port(), free_port()
    plan = dataclasses.replace(plan, bind=f"127.0.0.1:{api}", metrics_bind=f"127.0.0.1:{metrics}")
    with running_haproxy(tmp_path, plan):

        def scrape(port):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                    return resp.status, resp.read().decode()
            except urllib.error.HTTPError as err:
                return err.code, ""
            except urllib.error.URLError:
                return None

        status_code, text = wait_for(lambda: scrape(metrics))
        assert status_code == 200
        for b in plan.backends:
            for s in b.servers:
                series = rf'haproxy_server_status\{{proxy="{b.name}",server="{s.name}",state="(\w+)"}} 1'
                states = re.findall(series, text)
                assert len(states) == 1, (s.name, states)  # one state at a time (UP until its checks fail)
        assert scrape(api)[0] != 200  # not on the API's address
    _, problems = gateway.build("gw", gw_knobs(gateway_port=8405), rigs)
    assert problems == ["gateway_metrics_port must differ from gateway_port (8405)"]
