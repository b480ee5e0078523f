"""The testbed's vLLM stand-in serves vLLM's /metrics (rigforge/testbed/openai_stub.py `VLLM_METRICS`): the names the
alerting rules read, in the Prometheus text format, with values that follow what the stub really does.

The stub runs in this process on 127.0.0.1 (no testbed); each scrape is read with a strict parser of the text format
below and checked by `promtool check metrics` (Debian's prometheus package, installed by .ci/run).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from rigforge.testbed.openai_stub import (
    NOT_ALERTED,
    PROMPT_TOKENS,
    TTFT_BUCKETS,
    VLLM_METRICS,
    Schedule,
    make_server,
)

REPO = Path(__file__).resolve().parents[1]
RULES = REPO / "templates/monitor/rigforge-alerts.rules.yml"
NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
SAMPLE = re.compile(rf"({NAME})\{{((?:[a-zA-Z_][a-zA-Z0-9_]*=\"(?:[^\"\\]|\\.)*\",?)*)\}} (\S+)")
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
SUFFIXES = {"counter": ("",), "gauge": ("",), "histogram": ("_bucket", "_count", "_sum")}


def parse(text: str) -> dict[str, dict]:
    """{family: {"type", "help", "samples": {(sample name, labels tuple): float}}}. Strict: every sample belongs to
    the family whose HELP and TYPE came just before it (a histogram's by its suffix), a family appears once, no
    sample twice, every value a number."""
    families: dict[str, dict] = {}
    current = None
    assert text.endswith("\n")
    for line in text.splitlines():
        if m := re.fullmatch(rf"# HELP ({NAME}) (.+)", line):
            assert m[1] not in families, f"family {m[1]} appears twice"
            current = families[m[1]] = {"name": m[1], "help": m[2], "type": None, "samples": {}}
        elif m := re.fullmatch(rf"# TYPE ({NAME}) (counter|gauge|histogram)", line):
            assert current is families.get(m[1]) and current["type"] is None, line
            current["type"] = m[2]
        else:
            m = SAMPLE.fullmatch(line)
            assert m and current and current["type"], f"not a sample: {line!r}"
            assert m[1] in {current["name"] + s for s in SUFFIXES[current["type"]]}, f"not of {current['name']}: {line}"
            key = (m[1], tuple(LABEL.findall(m[2])))
            assert key not in current["samples"], f"duplicate sample: {line}"
            current["samples"][key] = float(m[3])
    return families


def promtool_check_metrics(text: str) -> None:
    """promtool parses the text; its only lint is the one vLLM's own names draw (a ':' in a name is meant for
    recording rules, and vLLM uses it anyway)."""
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: apt-get install prometheus (.ci/run installs it)"
    r = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    lint = [line for line in (r.stdout + r.stderr).splitlines() if line.strip()]
    assert r.returncode in (0, 3), r.stdout + r.stderr  # 3: lint problems only (1: the text did not parse)
    assert all(line.endswith("metric names should not contain ':'") for line in lint), lint
    assert sorted(line.split()[0] for line in lint) == sorted(VLLM_METRICS)


class Stub:
    def __init__(self, schedule: Schedule):
        self.schedule = schedule
        self.server = make_server(schedule)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def scrape(self) -> tuple[str, dict]:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            text = r.read().decode()
        return text, parse(text)

    def value(self, families: dict, name: str, sample: str | None = None, **extra: str) -> float:
        labels = (("model_name", self.schedule.model), ("engine", "0"), *extra.items())
        return families[name]["samples"][(sample or name, labels)]

    def chat(self, stream: bool, key: str | None = None) -> dict:
        """The completion's usage and the tokens it carried (a stream's deltas counted as they arrived)."""
        body = {"messages": [{"role": "user", "content": "hi"}], "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        req = urllib.request.Request(f"{self.url}/v1/chat/completions", json.dumps(body).encode(), headers)
        with urllib.request.urlopen(req, timeout=30) as r:
            if not stream:
                return json.loads(r.read())["usage"]
            chunks = [json.loads(line[6:]) for line in r.read().decode().splitlines() if line.startswith("data: {")]
        usage = next(c["usage"] for c in chunks if c.get("usage"))
        deltas = sum(1 for c in chunks for ch in c["choices"] if ch["delta"].get("content"))
        return {**usage, "deltas": deltas}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stub():
    s = Stub(Schedule(ttft_ms=600, dt_ms=50, tokens=10, tokens_per_delta=2, max_concurrent=1, api_key="sk-rig"))
    yield s
    s.close()


def wait_for(stub: Stub, what, timeout: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        families = stub.scrape()[1]
        if what(families):
            return families
        assert time.monotonic() < deadline, "the metrics never showed it"
        time.sleep(0.02)


def test_metrics_follow_what_the_stub_does(stub):
    text, before = stub.scrape()
    promtool_check_metrics(text)
    assert {f: before[f]["type"] for f in before} == {name: kind for name, (kind, _) in VLLM_METRICS.items()}
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
    ):
        assert stub.value(before, name) == 0, name

    # one streamed completion generating, a plain one waiting for the single slot behind it
    replies = {}
    first = threading.Thread(target=lambda: replies.update(stream=stub.chat(True, "sk-rig")))
    first.start()
    running = "vllm:num_requests_running"
    wait_for(stub, lambda f: stub.value(f, running) == 1)
    second = threading.Thread(target=lambda: replies.update(plain=stub.chat(False, "sk-rig")))
    second.start()
    busy = wait_for(stub, lambda f: stub.value(f, "vllm:num_requests_waiting") == 1)
    assert stub.value(busy, running) == 1
    assert 0 < stub.value(busy, "vllm:kv_cache_usage_perc") <= 1
    first.join(30)
    second.join(30)

    text, after = stub.scrape()
    promtool_check_metrics(text)
    stream, plain = replies["stream"], replies["plain"]
    assert stream["completion_tokens"] == 2 * stream["deltas"] == 10  # 5 deltas of 2 tokens
    assert stub.value(after, running) == stub.value(after, "vllm:num_requests_waiting") == 0
    assert stub.value(after, "vllm:kv_cache_usage_perc") == 0  # nothing running holds the cache
    assert stub.value(after, "vllm:prompt_tokens_total") == stream["prompt_tokens"] + plain["prompt_tokens"]
    assert stream["prompt_tokens"] == plain["prompt_tokens"] == PROMPT_TOKENS
    tokens = stream["completion_tokens"] + plain["completion_tokens"]
    assert stub.value(after, "vllm:generation_tokens_total") == tokens  # what the replies carried

    ttft = "vllm:time_to_first_token_seconds"
    assert stub.value(after, ttft, f"{ttft}_count") == 2
    buckets = [stub.value(after, ttft, f"{ttft}_bucket", le=repr(b)) for b in TTFT_BUCKETS]
    assert buckets == sorted(buckets) and stub.value(after, ttft, f"{ttft}_bucket", le="+Inf") == 2
    # each first token came 0.6 s after generation began; the plain one's wait for the slot counts too
    assert stub.value(after, ttft, f"{ttft}_bucket", le="0.5") == 0
    assert stub.value(after, ttft, f"{ttft}_sum") >= 0.6 + 0.6


def test_metrics_need_no_api_key_as_in_vllm(stub):
    """vLLM's --api-key guards the /v1 routes only (its api_server's authentication middleware)."""
    with pytest.raises(urllib.error.HTTPError) as denied:
        urllib.request.urlopen(f"{stub.url}/v1/models", timeout=10)
    assert denied.value.code == 401
    stub.scrape()


def test_every_vllm_name_the_alert_rules_read_is_served_and_watched():
    """The rules read the stand-in's names, and an absent() rule watches every one it serves: a rename in either
    fails here, not silently in a live fleet."""
    rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    read = set(re.findall(r"\bvllm:[a-zA-Z0-9_:]+", " ".join(r["expr"] for r in rules)))
    families = set(VLLM_METRICS)

    def family(name: str) -> str | None:
        return next((f for f in families if name in {f + s for s in SUFFIXES[VLLM_METRICS[f][0]]}), None)

    assert {n: family(n) for n in read if family(n) is None} == {}, "read by the rules, not served by the stand-in"
    scoped = r"absent\((vllm:[a-z_:]+)\) and on \(\) count\(up\{serving_engine=\"vllm\"\}\) > 0"  # vLLM rigs only
    watched = {family(m[1]) for r in rules if (m := re.fullmatch(scoped, r["expr"]))}
    assert watched == families - set(NOT_ALERTED)  # the prefix cache's counters: a cold cache is not a fault


def test_the_image_entry_serves_metrics_as_the_served_model_name(tmp_path):
    """rigforge/testbed/image/vllm (`vllm serve` in the stand-in image) serves the same /metrics, labelled with
    --served-model-name as vLLM labels it."""
    (tmp_path / "config.json").write_text("{}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(REPO / "rigforge/testbed")}  # the image has it in /opt/rigforge-standin
    proc = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "rigforge/testbed/image/vllm"),
            "serve",
            "--model",
            str(tmp_path),
            "--served-model-name",
            "rig-model",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--api-key",
            "k",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert "serving rig-model" in proc.stdout.readline()
        deadline = time.monotonic() + 15
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    text = r.read().decode()
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read() if proc.poll() else ""
                time.sleep(0.05)
    finally:
        proc.terminate()
        proc.wait(10)
    families = parse(text)
    assert set(families) == set(VLLM_METRICS)
    assert ("vllm:num_requests_running", (("model_name", "rig-model"), ("engine", "0"))) in (
        families["vllm:num_requests_running"]["samples"]
    )
