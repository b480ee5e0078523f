"""Benchmark (not a test): requests through the fleet gateway while the fleet rolls a variant out and back.

A bounded load of chat completions (8 concurrent clients, every other one streamed) goes to the gateway on
loopback for a fixed time before, during and after a rolling switch (`pyinfra --serial`) of every rig from
dual-turbo to dual and back (both serve the same model name). Printed per phase: requests sent, failed, p50 and
p99 latency, completed requests and tokens per second. A request fails when it gets no 200, or a stream ends
without [DONE].

    sudo .venv/bin/python benchmarks/bench_rollout.py --gateway http://127.0.0.1:PORT --inventory INV \\
        [--key KEY] [--clients 8] [--settle 20]

Rig-death mode (docs/gateway.md "When a rig dies"): the same load, then KILL (a shell command: kill one rig's
serving container, or power the rig off) and, every 0.2 s, STAT (a shell command printing the gateway's `show
stat`) until RIG is DOWN, then until it is UP again (systemd restarts it), then SETTLE seconds more. Printed:
the requests sent before / after the kill and how many failed, seconds from the kill to DOWN and to UP.

    sudo .venv/bin/python benchmarks/bench_rollout.py --gateway URL --rig-death rig2 \\
        --kill "ssh rig2 'docker kill -s KILL \\$(docker ps -q)'" \\
        --stat "ssh gw 'echo show stat | sudo socat stdio UNIX-CONNECT:/run/haproxy/rigforge-admin.sock'"

`rigforge testbed up --booted --rigs 3 --gateway` prints the gateway's address and writes the inventory.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYINFRA = str(Path(sys.executable).with_name("pyinfra"))
MODEL = "qwen3.6-27b-autoround"


class Load:
    """`clients` threads sending chat completions back to back, each its own prompt (its own conversation: under
    the gateway's prefix affinity, the clients spread over the rigs); every result is (start, seconds, ok, tokens,
    why it failed: the HTTP status or the error's name, "" when it did not)."""

    def __init__(self, url: str, key: str | None, clients: int, max_tokens: int):
        self.url, self.key, self.max_tokens = f"{url}/v1/chat/completions", key, max_tokens
        self.results: list[tuple[float, float, bool, int, str]] = []
        self.stop = threading.Event()
        self.threads = [
            threading.Thread(target=self._client, args=(i % 2 == 0, i), daemon=True) for i in range(clients)
        ]

    def _one(self, stream: bool, client: int = 0) -> tuple[bool, int, str]:
        messages = [{"role": "user", "content": f"Count. (client {client})"}]
        body = {"model": MODEL, "messages": messages, "max_tokens": self.max_tokens}
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {self.key}"} if self.key else {})}
        req = urllib.request.Request(self.url, json.dumps(body).encode(), headers)
        try:
            with urllib.request.urlopen(req, timeout=300) as resp:
                data = resp.read()
        except urllib.error.HTTPError as err:
            return False, 0, f"HTTP {err.code}"
        except (urllib.error.URLError, ConnectionError, http.client.HTTPException, ValueError, TimeoutError) as err:
            return False, 0, type(getattr(err, "reason", err)).__name__
        if stream:
            done = data.rstrip().endswith(b"data: [DONE]")
            return done, data.count(b'"delta": {"content"'), "" if done else "stream cut"
        try:
            return True, json.loads(data)["usage"]["completion_tokens"], ""
        except (ValueError, KeyError):
            return False, 0, "bad body"

    def _client(self, stream: bool, client: int) -> None:
        while not self.stop.is_set():
            t0 = time.monotonic()
            ok, tokens, why = self._one(stream, client)
            self.results.append((t0, time.monotonic() - t0, ok, tokens, why))

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join()


def phase(results, start: float, end: float) -> dict:
    """The requests sent in [start, end): counts, latency percentiles, throughput of those completed."""
    mine = [r for r in results if start <= r[0] < end]
    ok = [r for r in mine if r[2]]
    lat = sorted(r[1] for r in ok)
    span = max(end - start, 1e-9)
    why = sorted({r[4] for r in mine if not r[2]})
    return {
        "sent": len(mine),
        "failed": len(mine) - len(ok),
        "failures": {w: [round(r[0] - start, 1) for r in mine if r[4] == w][:5] for w in why},  # first seconds
        "p50_s": round(statistics.median(lat), 3) if lat else None,
        "p99_s": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))], 3) if lat else None,
        "req_per_s": round(len(ok) / span, 2),
        "tokens_per_s": round(sum(r[3] for r in ok) / span, 1),
        "seconds": round(span, 1),
    }


def rollout(inventory: str) -> list[dict]:
    """Every rig to dual, one at a time, then back to dual-turbo; each run's exit code and time."""
    runs = []
    for entry in ("dual", "dual_turbo"):
        t0 = time.monotonic()
        proc = subprocess.run(
            [PYINFRA, "-y", "--serial", inventory, str(REPO / "deploy" / f"{entry}.py")],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        runs.append({"deploy": entry, "rc": proc.returncode, "seconds": round(time.monotonic() - t0, 1)})
        if proc.returncode:
            print(proc.stderr[-4000:], file=sys.stderr)
    return runs


def server_status(stat: str, rig: str) -> str:
    """`rig`'s status (UP, DOWN, ...) in HAProxy's `show stat` CSV; "" when absent."""
    lines = stat.splitlines()
    header = lines[0].lstrip("# ").split(",") if lines else []
    for line in lines[1:]:
        row = dict(zip(header, line.split(","), strict=False))
        if row.get("svname") == rig:
            return row.get("status", "")
    return ""


def rig_death(load: Load, rig: str, kill: str, stat: str, settle: float, wait: float = 300) -> dict:
    """Under `load`: run `kill`, then poll `stat` until `rig` is DOWN and then UP again; settle; the report."""

    def status() -> str:
        return server_status(subprocess.run(stat, shell=True, capture_output=True, text=True).stdout, rig)

    t0 = time.monotonic()
    time.sleep(settle)
    t_kill = time.monotonic()
    subprocess.run(kill, shell=True, check=True)
    down = up = None
    while time.monotonic() - t_kill < wait and (down is None or up is None):
        now, state = time.monotonic(), status()
        if down is None and state.startswith("DOWN"):
            down = now - t_kill
        elif down is not None and state.startswith("UP"):
            up = now - t_kill
        time.sleep(0.2)
    time.sleep(settle)
    before, after = phase(load.results, t0, t_kill), phase(load.results, t_kill, time.monotonic())
    return {
        "rig": rig,
        "down_after_s": down and round(down, 2),
        "up_after_s": up and round(up, 2),
        "before_kill": before,
        "after_kill": after,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gateway", required=True, help="the gateway's URL, e.g. http://127.0.0.1:18088")
    p.add_argument("--inventory", help="the fleet's inventory (rigs and the gateway group): the rollout mode")
    p.add_argument("--rig-death", metavar="RIG", help="rig-death mode: the gateway's server name of the rig killed")
    p.add_argument("--kill", help="rig-death mode: the shell command that kills it")
    p.add_argument("--stat", help="rig-death mode: a shell command printing the gateway's `show stat`")
    p.add_argument("--key", help="the fleet's gateway_api_key, if set")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=40)
    p.add_argument("--settle", type=float, default=20, help="seconds of load before and after the rollout")
    a = p.parse_args()
    if a.rig_death:
        if not (a.kill and a.stat):
            p.error("--rig-death needs --kill and --stat")
        with Load(a.gateway, a.key, a.clients, a.max_tokens) as load:
            report = rig_death(load, a.rig_death, a.kill, a.stat, a.settle)
        print(json.dumps({"clients": a.clients, **report}, indent=2))
        return 1 if report["after_kill"]["failed"] or report["down_after_s"] is None else 0
    if not a.inventory:
        p.error("--inventory is required (or --rig-death)")
    with Load(a.gateway, a.key, a.clients, a.max_tokens) as load:
        t0 = time.monotonic()
        time.sleep(a.settle)
        t1 = time.monotonic()
        runs = rollout(a.inventory)
        t2 = time.monotonic()
        time.sleep(a.settle)
        t3 = time.monotonic()
    report = {
        "clients": a.clients,
        "rollout": runs,
        "before": phase(load.results, t0, t1),
        "during": phase(load.results, t1, t2),
        "after": phase(load.results, t2, t3),
    }
    print(json.dumps(report, indent=2))
    failed = sum(report[k]["failed"] for k in ("before", "during", "after"))
    return 1 if failed or any(r["rc"] for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
