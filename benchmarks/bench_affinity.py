"""Benchmark (not a test): prefix affinity against least connections at the fleet gateway, on agent-shaped traffic.

Three vLLM stand-ins (rigforge/testbed/openai_stub.py, each its own process on 127.0.0.1, each keeping vLLM's prefix
cache within a KV budget) behind Debian's HAProxy, configured by rigforge/model/gateway.py as a gateway host would be.
The workload: AGENTS agents, each with its own system prompt of 10-20 KB; CONVERSATIONS conversations spread over
them, each of 3-12 turns; every turn re-sends the whole conversation (system prompt, then every earlier message)
plus a new message of 0.5-6 KB (a tool result, a file, an instruction), and the answer is appended as the next
turn's history (0.3-2 KB). CLIENTS conversations run at once, each turn after the previous one's answer.

Per policy (least connections; prefix affinity at each hash-balance-factor asked), on fresh stand-ins (cold
caches) and a fresh HAProxy:
- the fleet's prefix cache hit rate: hits / queries, from the stand-ins' own vllm:prefix_cache_* counters;
- the highest rig's share of requests against the average (1.00: even);
- affinity only: each conversation's home (its rig with the gateway idle, one turn at a time), the turns under load
  that the load bound sent elsewhere; then one rig is stopped: how many conversations move (one turn each, one at
  a time) against how many it held, and under load; then it is started again (cold, as a restarted vLLM is): how
  many return home.

    .venv/bin/python benchmarks/bench_affinity.py [--agents 6] [--conversations 48] [--clients 8]
        [--kv-blocks 8192] [--factors 125,150,200] [--seed 1] [--session-header]

Needs Debian's haproxy on PATH (or /usr/sbin/haproxy); uses nothing but 127.0.0.1.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rigforge.model import gateway  # noqa: E402
from rigforge.model.fleet import plan_for  # noqa: E402
from rigforge.model.knobs import gateway as gateway_knobs  # noqa: E402

HAPROXY = shutil.which("haproxy") or "/usr/sbin/haproxy"
MODEL = "qwen3.6-27b-autoround"
RIGS = ("rig1", "rig2", "rig3")
WORDS = (
    "the of and to in is that for it as with was on be by this are from or have an not which at but were all "
    "function return value config file test error module class import self none true false list dict rig "
    "gateway prefix cache token block model serve request response stream client agent tool"
).split()


@dataclass(frozen=True)
class Conversation:
    n: int
    agent: int
    turns: tuple[tuple[dict, ...], ...]  # each turn's messages, as sent


def text(rng: random.Random, size: int) -> str:
    """About `size` bytes of words."""
    out, length = [], 0
    while length < size:
        word = rng.choice(WORDS)
        out.append(word)
        length += len(word) + 1
    return " ".join(out)


def workload(agents: int, conversations: int, seed: int) -> list[Conversation]:
    """The conversations: agent i's system prompt is 10-20 KB; each conversation grows turn by turn."""
    rng = random.Random(seed)
    prompts = [f"You are agent {a}. " + text(rng, rng.randint(10_000, 20_000)) for a in range(agents)]
    out = []
    for n in range(conversations):
        agent = n % agents
        messages: list[dict] = [{"role": "system", "content": prompts[agent]}]
        turns = []
        for turn in range(rng.randint(3, 12)):
            messages = [
                *messages,
                {"role": "user", "content": f"task {n}.{turn}: " + text(rng, rng.randint(500, 6000))},
            ]
            turns.append(tuple(messages))
            messages = [*messages, {"role": "assistant", "content": text(rng, rng.randint(300, 2000))}]
        out.append(Conversation(n, agent, tuple(turns)))
    return out


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stub:
    """One stand-in rig in its own process, named on its answers (X-Stub-Name)."""

    def __init__(self, name: str, kv_blocks: int, port: int = 0) -> None:
        """Started on `port` (0: a free one) with a prefix cache of `kv_blocks` blocks; answers once this returns."""
        self.name, self.kv_blocks = name, kv_blocks
        cmd = [
            sys.executable,
            "-m",
            "rigforge.testbed.openai_stub",
            "--port",
            str(port),
            "--name",
            name,
            "--kv-blocks",
            str(kv_blocks),
            "--ttft-ms",
            "20",
            "--dt-ms",
            "2",
            "--tokens",
            "16",
        ]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True)
        self.url = self.proc.stdout.readline().strip()
        self.port = int(self.url.rsplit(":", 1)[1])

    def counters(self) -> tuple[float, float]:
        """(vllm:prefix_cache_queries_total, vllm:prefix_cache_hits_total) from its /metrics."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as resp:
            body = resp.read().decode()
        found = dict(re.findall(r"^(vllm:prefix_cache_\w+)\{[^}]*\} (\S+)$", body, re.M))
        return float(found["vllm:prefix_cache_queries_total"]), float(found["vllm:prefix_cache_hits_total"])

    def stop(self) -> None:
        """Terminated (its cache gone with it, as a restarted vLLM's)."""
        self.proc.terminate()
        self.proc.wait(timeout=10)


class Gateway:
    """Debian's HAProxy on the config rigforge renders for a gateway host in front of `stubs`."""

    def __init__(self, stubs: dict[str, Stub], tmp: Path, **knobs: object) -> None:
        """Rendered with the gateway `knobs` (defaults otherwise), started, returned once every rig is UP."""
        rigs = []
        for name, stub in stubs.items():
            plan, problems = plan_for(
                name,
                {"rigforge_variant": "dual", "serving_port": stub.port, "gateway_address": "127.0.0.1"},
                gpus=2,
                deployable=False,
            )
            assert not problems, problems
            rigs.append(plan)
        self.port = free_port()
        data = {**gateway_knobs.DEFAULTS, "gateway_port": self.port, "gateway_bind_address": "127.0.0.1", **knobs}
        data["gateway_metrics_port"] = free_port()
        plan, problems = gateway.build("gw", gateway_knobs.Gateway.of(data), rigs)
        assert not problems, problems
        self.plan = replace(plan, admin_socket=str(tmp / "admin.sock"), state_file=str(tmp / "state"))
        cfg = tmp / "haproxy.cfg"
        cfg.write_text(gateway.render(self.plan))
        self.proc = subprocess.Popen(
            [HAPROXY, "-db", "-f", str(cfg)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self.wait(lambda s: all(s.get(r, {}).get("status") == "UP" for r in stubs))

    def stat(self) -> dict[str, dict]:
        """`show stat` of the backend: {server or "BACKEND": its row}; {} before HAProxy answers."""
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(self.plan.admin_socket)
                s.sendall(b"show stat\n")
                out = b""
                while chunk := s.recv(65536):
                    out += chunk
        except OSError:
            return {}
        lines = out.decode().splitlines()
        header = lines[0].lstrip("# ").split(",")
        rows = [dict(zip(header, line.split(","), strict=False)) for line in lines[1:] if line.startswith("m_")]
        return {row["svname"]: row for row in rows}

    def wait(self, predicate: Callable[[dict[str, dict]], bool], timeout: float = 20.0) -> None:
        """Until `predicate(self.stat())` holds; exits the benchmark, saying so, after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while not predicate(self.stat()):
            if time.monotonic() > deadline:
                raise SystemExit("the gateway never got there: " + json.dumps(self.stat())[:500])
            time.sleep(0.05)

    def send(self, messages: tuple[dict, ...], session: str | None) -> str:
        """One chat completion: the rig that answered it ("" when none did)."""
        body = {"messages": list(messages), "model": MODEL, "max_tokens": 16}
        headers = {"Content-Type": "application/json", **({"X-Session-Id": session} if session else {})}
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/chat/completions", json.dumps(body).encode(), headers
        )
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                resp.read()
                return resp.headers.get("X-Stub-Name", "")
        except OSError:
            return ""

    def send_idle(self, messages: tuple[dict, ...], session: str | None) -> str:
        """One request with nothing else in flight (the load bound cannot act): where the hash alone sends it."""
        self.wait(lambda s: s.get("BACKEND", {}).get("scur") == "0")
        return self.send(messages, session)

    def stop(self) -> None:
        """HAProxy stopped."""
        self.proc.terminate()
        self.proc.wait(timeout=10)


def play(
    gw: Gateway, jobs: list[list[tuple[int, tuple[dict, ...]]]], clients: int, sessions: bool
) -> list[tuple[int, str]]:
    """`clients` threads, each taking the next job (a conversation's turns, one after the other): [(n, rig)]."""
    queue = collections.deque(jobs)
    lock = threading.Lock()
    taken: list[tuple[int, str]] = []

    def client() -> None:
        """Jobs until none is left."""
        while True:
            with lock:
                if not queue:
                    return
                job = queue.popleft()
            for n, messages in job:
                rig = gw.send(messages, f"conversation-{n}" if sessions else None)
                with lock:
                    taken.append((n, rig))

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return taken


def sample_in_flight(gw: Gateway, done: threading.Event, samples: list[list[int]]) -> None:
    """Every 20 ms until `done`: each rig's requests in flight at the gateway (`show stat` scur)."""
    while not done.is_set():
        stat = gw.stat()
        samples.append([int(stat.get(rig, {}).get("scur") or 0) for rig in RIGS])
        time.sleep(0.02)


def hit_rate(stubs: dict[str, Stub], before: dict[str, tuple[float, float]]) -> tuple[float, float, float]:
    """(queries, hits, hits / queries) of the fleet since `before`."""
    queries = hits = 0.0
    for name, stub in stubs.items():
        q, h = stub.counters()
        queries += q - before[name][0]
        hits += h - before[name][1]
    return queries, hits, hits / queries if queries else 0.0


def share(taken: list[tuple[int, str]]) -> tuple[dict[str, int], float]:
    """Requests per rig, and the highest rig's against the average."""
    per_rig = collections.Counter(rig for _, rig in taken)
    average = sum(per_rig.values()) / len(RIGS)
    return dict(sorted(per_rig.items())), max(per_rig.values()) / average


def run(policy: str, factor: int, convs: list[Conversation], args: argparse.Namespace, tmp: Path) -> dict:
    """One policy on fresh stand-ins and a fresh gateway: the figures of the module's docstring."""
    stubs = {name: Stub(name, args.kv_blocks) for name in RIGS}
    knobs = {"gateway_balance": policy, "gateway_hash_balance_factor": factor}
    (tmp / f"{policy}-{factor}").mkdir()
    gw = Gateway(stubs, tmp / f"{policy}-{factor}", **knobs)
    report: dict = {"policy": policy if policy == "leastconn" else f"affinity, factor {factor}"}
    try:
        before = {name: stub.counters() for name, stub in stubs.items()}
        t0 = time.monotonic()
        jobs = [[(c.n, messages) for messages in c.turns] for c in convs]
        done = threading.Event()
        samples: list[list[int]] = []
        sampler = threading.Thread(target=sample_in_flight, args=(gw, done, samples))
        sampler.start()
        taken = play(gw, jobs, args.clients, args.session_header)
        done.set()
        sampler.join()
        report["seconds"] = round(time.monotonic() - t0, 1)
        report["requests"] = len(taken)
        report["failed"] = sum(1 for _, rig in taken if not rig)
        queries, hits, rate = hit_rate(stubs, before)
        report["hit_rate"] = round(rate, 3)
        report["tokens_queried"], report["tokens_hit"] = int(queries), int(hits)
        report["per_rig"], top = share(taken)
        report["top_share_vs_average"] = round(top, 2)
        busy = [max(rigs) / (sum(rigs) / len(RIGS)) for rigs in samples if sum(rigs) >= max(3, args.clients // 2)]
        report["in_flight_top_vs_average"] = {"max": round(max(busy), 2), "mean": round(sum(busy) / len(busy), 2)}
        rigs_of = collections.defaultdict(list)
        for n, rig in taken:
            rigs_of[n].append(rig)
        report["conversations_on_more_than_one_rig"] = sum(1 for rigs in rigs_of.values() if len(set(rigs)) > 1)
        if policy == "affinity":
            report |= moves(gw, stubs, convs, taken, args)
    finally:
        gw.stop()
        for stub in stubs.values():
            stub.stop()
    return report


def moves(
    gw: Gateway,
    stubs: dict[str, Stub],
    convs: list[Conversation],
    taken: list[tuple[int, str]],
    args: argparse.Namespace,
) -> dict:
    """Homes, the turns the load bound moved, and what moves when a rig goes down and comes back."""
    session = (lambda n: f"conversation-{n}") if args.session_header else (lambda n: None)
    last = {c.n: c.turns[-1] for c in convs}
    home = {n: gw.send_idle(m, session(n)) for n, m in last.items()}
    out: dict = {"homes": dict(sorted(collections.Counter(home.values()).items()))}
    away = [(n, rig) for n, rig in taken if rig != home[n]]
    out["turns_moved_by_the_load_bound"] = len(away)
    out["conversations_with_a_turn_moved_by_the_bound"] = len({n for n, _ in away})

    gone = max(out["homes"], key=out["homes"].get)  # the rig holding the most conversations
    held = {n for n, rig in home.items() if rig == gone}
    port = stubs[gone].port
    stubs[gone].stop()
    gw.wait(lambda s: s.get(gone, {}).get("status", "").startswith("DOWN"))
    down = {n: gw.send_idle(m, session(n)) for n, m in last.items()}
    moved = {n for n in down if down[n] != home[n]}
    out["down"] = {
        "rig": gone,
        "conversations_it_held": len(held),
        "moved": len(moved),
        "moved_not_held": len(moved - held),
    }
    loaded = play(gw, [[(n, m)] for n, m in last.items()], args.clients, args.session_header)
    out["down"]["under_load_moved_not_held"] = sum(1 for n, rig in loaded if n not in held and rig != home[n])
    out["down"]["under_load_failed"] = sum(1 for _, rig in loaded if not rig)

    stubs[gone] = Stub(gone, args.kv_blocks, port)  # back, cold
    gw.wait(lambda s: s.get(gone, {}).get("status") == "UP")
    back = {n: gw.send_idle(m, session(n)) for n, m in last.items()}
    out["back"] = {
        "returned_home": sum(1 for n in held if back[n] == gone),
        "others_moved": sum(1 for n in back if n not in held and back[n] != home[n]),
    }
    return out


def main(argv: list[str] | None = None) -> int:
    """The workload, then each policy's report as a JSON line on stdout."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--agents", type=int, default=6)
    p.add_argument("--conversations", type=int, default=48)
    p.add_argument("--clients", type=int, default=8, help="conversations running at once")
    p.add_argument("--kv-blocks", type=int, default=8192, help="each stand-in's KV budget, blocks of 16 tokens")
    p.add_argument("--factors", default="150", help="hash-balance-factor values to run affinity at (comma-separated)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--session-header", action="store_true", help="clients send X-Session-Id (the key when sent)")
    args = p.parse_args(argv)
    convs = workload(args.agents, args.conversations, args.seed)
    turns = sum(len(c.turns) for c in convs)
    biggest = max(len(json.dumps(c.turns[-1])) for c in convs)
    print(
        f"# {args.agents} agents, {len(convs)} conversations, {turns} turns (largest request {biggest // 1024} KB), "
        f"{args.clients} at once, KV budget {args.kv_blocks} blocks ({args.kv_blocks * 16} tokens) a rig, "
        f"seed {args.seed}{', X-Session-Id sent' if args.session_header else ''}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="bench-affinity-") as tmp:
        runs = [("leastconn", gateway_knobs.DEFAULTS["gateway_hash_balance_factor"])]
        runs += [("affinity", int(f)) for f in args.factors.split(",")]
        for policy, factor in runs:
            print(json.dumps(run(policy, factor, convs, args, Path(tmp))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
