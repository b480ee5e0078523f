"""The fleet page on a real Prometheus (tests/test_fleet_page.py, benchmarks/fleet_page_screenshot.py).

- `openmetrics`: an hour of the series the page reads, for some rigs, as OpenMetrics text;
- `running_prometheus`: Debian's /usr/bin/prometheus on 127.0.0.1, its storage backfilled with that text by
  `promtool tsdb create-blocks-from openmetrics`, serving the repo's consoles and console libraries;
- `chromium`: headless Debian chromium (`--no-sandbox`: tests run as root) dumping the DOM after the page's
  JavaScript ran, or taking a screenshot.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import math
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from html.parser import HTMLParser
from pathlib import Path

from rigforge.model.gateway import backend_name

REPO = Path(__file__).resolve().parents[1]
CONSOLES = REPO / "templates/monitor/consoles"
LIBRARIES = REPO / "templates/monitor/console_libraries"
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"  # Debian's prometheus (.ci/run installs it)
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
STEP_S = 15  # the Fleet's scrape interval
RIGS = {"rig1": True, "rig2": True, "rig3": False}  # the test's rigs; rig3: its vLLM target down all hour
HIT_RATES = {"rig1": 0.62, "rig2": 0.35, "rig3": 0.5}  # prefix cache hits / queries, where vLLM is up
RETRIES = {"rig2": 6}  # retries at the gateway over the hour
BACKEND = backend_name("qwen3.6-27b-autoround")  # the gateway's backend for the rigs' model


def chromium_binary() -> str | None:
    """Debian's chromium on PATH, else None."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


def openmetrics(rigs: dict[str, bool], end: int, minutes: int = 60, gpus: int = 2) -> str:
    """An hour (to `end`, unix seconds) of scrapes for each rig: its node exporter's `up` and GPU series and, where
    `rigs[name]` is true, its vLLM's `up` and metrics (else vLLM's target is down the whole time: `up` 0, no
    metrics), and the gateway's HAProxy exporter's series for it (UP and answering where vLLM is up, else DOWN).
    Where vLLM is up, its prefix cache hits are HIT_RATES[rig] of its queries, and its retries at the gateway
    RETRIES[rig] over the hour. Deterministic: smooth curves with a phase per rig and GPU."""
    times = [end - minutes * 60 + i * STEP_S for i in range(minutes * 60 // STEP_S + 1)]
    families: dict[str, tuple[str, list[str]]] = {}

    def series(name: str, kind: str, labels: dict, value):
        family = name.removesuffix("_total") if kind == "counter" else name
        text = ",".join(f'{k}="{v}"' for k, v in labels.items())
        lines = families.setdefault(family, (kind, []))[1]
        lines.extend(f"{name}{{{text}}} {value(i, t):.6g} {t}" for i, t in enumerate(times))

    for n, (rig, vllm_up) in enumerate(rigs.items()):
        node = {"job": "node", "instance": f"{rig}:9100", "rig": rig}
        series("up", "gauge", node, lambda i, t: 1)
        vllm = {"job": "vllm", "instance": f"{rig}:8010", "rig": rig}
        series("up", "gauge", vllm, lambda i, t, up=vllm_up: 1 if up else 0)
        for gpu in range(gpus):
            labels = {**node, "gpu": str(gpu)}
            phase = n * 1.3 + gpu * 0.7
            series("rigforge_gpu_declared_cap_watts", "gauge", labels, lambda i, t: 230)
            series("rigforge_gpu_power_limit_watts", "gauge", labels, lambda i, t: 230)
            series("rigforge_gpu_present", "gauge", labels, lambda i, t: 1)
            series("rigforge_gpu_cap_setbacks_total", "counter", labels, lambda i, t: 0)
            series(
                "rigforge_gpu_power_draw_watts",
                "gauge",
                labels,
                lambda i, t, p=phase: 175 + 45 * math.sin(i / 23 + p) + 8 * math.sin(i / 3.1 + p),
            )
            series(
                "rigforge_gpu_temperature_celsius", "gauge", labels, lambda i, t, p=phase: 62 + 9 * math.sin(i / 31 + p)
            )
        server = {"job": "haproxy", "instance": "gw:8405", "gateway": "gw", "proxy": BACKEND, "server": rig}
        for state in ("UP", "DOWN", "MAINT", "DRAIN", "NOLB"):
            now = "UP" if vllm_up else "DOWN"
            series("haproxy_server_status", "gauge", {**server, "state": state}, lambda i, t, v=int(state == now): v)
        series("haproxy_server_current_queue", "gauge", server, lambda i, t: 0)
        retries = RETRIES.get(rig, 0) if vllm_up else 0
        series(
            "haproxy_server_retry_warnings_total", "counter", server, lambda i, t, r=retries: i * r // (len(times) - 1)
        )
        if not vllm_up:
            continue
        answered = {**server, "code": "2xx"}
        series("haproxy_server_http_responses_total", "counter", answered, lambda i, t, n=n: i * STEP_S * (2 + n))
        load = {"model_name": "Qwen/Qwen3-32B-AWQ", "engine": "0", **vllm}
        queried = {"vllm:prefix_cache_queries_total": 1.0, "vllm:prefix_cache_hits_total": HIT_RATES[rig]}
        for name, share in queried.items():
            series(name, "counter", load, lambda i, t, f=share: round(f * 4000 * i * STEP_S))

        def tps(i, n=n):
            return 55 + 25 * math.sin(i / 29 + n) + 6 * math.sin(i / 4.3)

        series("vllm:generation_tokens_total", "counter", load, lambda i, t: sum(tps(j) * STEP_S for j in range(i)))
        series("vllm:prompt_tokens_total", "counter", load, lambda i, t: sum(3 * tps(j) * STEP_S for j in range(i)))
        series("vllm:num_requests_running", "gauge", load, lambda i, t: round(tps(i) / 12))
        series("vllm:num_requests_waiting", "gauge", load, lambda i, t, n=n: max(0, round(3 * math.sin(i / 17 + n))))
        series("vllm:kv_cache_usage_perc", "gauge", load, lambda i, t: 0.2 + tps(i) / 160)
    out = []
    for family, (kind, lines) in families.items():
        out.append(f"# TYPE {family} {kind}")
        out.extend(lines)
    return "\n".join([*out, "# EOF", ""])


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_prometheus(work: Path, rigs: dict[str, bool], end: int | None = None) -> Iterator[str]:
    """Debian's prometheus on 127.0.0.1:PORT over an hour of backfilled series for `rigs` (see `openmetrics`),
    ending 10 s before now; yields its base URL. Nothing is scraped."""
    end = end or int(time.time()) - 10
    storage, data = work / "data", work / "fleet.om"
    storage.mkdir(parents=True)
    data.write_text(openmetrics(rigs, end))
    made = subprocess.run(
        [PROMTOOL, "tsdb", "create-blocks-from", "openmetrics", str(data), str(storage)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert made.returncode == 0, made.stdout + made.stderr
    config = work / "prometheus.yml"
    config.write_text("global:\n  scrape_interval: 15s\n")
    with prometheus(work, config) as url:
        yield url


class Page(HTMLParser):
    """The dumped DOM, reduced to: rig -> graph -> (state, {series: path d}, {legend text: value now}); and the text
    of what the page says now: `alerts` (each firing alert's data-alert, data-rig, data-gpu and text), per rig its
    heading (`headings`), each GPU's row (`gpus`: rig -> gpu -> (data-state, text)) and the gateway's cells
    (`gateway`: rig -> cell -> text)."""

    def __init__(self, dom: str):
        super().__init__()
        self.body: dict = {}
        self.rigs: dict[str, dict[str, dict]] = {}
        self.alerts: list[dict[str, str]] = []
        self.headings: dict[str, str] = {}
        self.gpus: dict[str, dict[str, tuple[str, str]]] = {}
        self.gateway: dict[str, dict[str, str]] = {}
        self.rig_name: str | None = None
        self.rig = self.graph = None
        self.item: list[str] | None = None
        self.text: tuple | None = None  # text being read: (its end tag, what it is, its key, the parts so far)
        self.feed(dom)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        """Where we are (section, figure, legend item) and which text to read next."""
        a = dict(attrs)
        if tag == "body":
            self.body = a
        elif tag == "section" and "data-rig" in a:
            self.rig_name = a["data-rig"]
            self.rig = self.rigs.setdefault(a["data-rig"], {})
        elif tag == "figure" and self.rig is not None:
            self.graph = self.rig.setdefault(a["data-graph"], {"state": a.get("data-state"), "paths": {}, "legend": {}})
        elif tag == "path" and self.graph is not None and "data-series" in a:
            self.graph["paths"][a["data-series"]] = a.get("d", "")
        elif tag == "li" and self.graph is not None:
            self.item = []
        elif tag == "li" and "data-alert" in a:
            self.alerts.append({"alert": a["data-alert"], "rig": a.get("data-rig", ""), "gpu": a.get("data-gpu", "")})
            self.text = ("li", "alert", None, [])
        elif tag == "h2" and self.rig_name is not None:
            self.text = ("h2", "heading", None, [])
        elif tag == "tr" and "data-gpu" in a and self.rig_name is not None:
            self.text = ("tr", "gpu", (a["data-gpu"], a.get("data-state", "")), [])
        elif tag == "td" and "data-gw" in a and self.rig_name is not None:
            self.text = ("td", "gateway", a["data-gw"], [])

    def handle_data(self, data: str) -> None:
        """Text of a legend item or of the element being read."""
        if self.item is not None:
            self.item.append(data)
        if self.text is not None:
            self.text[3].append(data)

    def handle_endtag(self, tag: str) -> None:
        """Keep what was read when its element ends."""
        if self.text is not None and tag == self.text[0]:
            self.keep_text(self.text[1], self.text[2], " ".join("".join(self.text[3]).split()))
            self.text = None
        if tag == "li" and self.item is not None:
            text = "".join(self.item).strip()
            label, _, value = text.rpartition(" ")
            if value == "now" and label.endswith(" none"):  # a series with no sample now: "none now"
                label, value = label.removesuffix(" none"), "none now"
            self.graph["legend"][label] = value
            self.item = None
        elif tag == "figure":
            self.graph = None
        elif tag == "section":
            self.rig = self.rig_name = None

    def keep_text(self, kind: str, key: str | tuple[str, str] | None, text: str) -> None:
        """Keep the text of an alert, a rig's heading, a GPU's row or a gateway cell where `Page` says."""
        if kind == "alert":
            self.alerts[-1]["text"] = text
        elif kind == "heading":
            self.headings[self.rig_name] = text
        elif kind == "gpu":
            gpu, state = key
            self.gpus.setdefault(self.rig_name, {})[gpu] = (state, text)
        else:
            self.gateway.setdefault(self.rig_name, {})[key] = text


def points(d: str) -> int:
    """The points of an SVG path's `d` (its M and L commands)."""
    return len(re.findall(r"[ML]\s*-?[\d.]+ -?[\d.]+", d))


def chromium(work: Path, *args: str, timeout: int = 90) -> subprocess.CompletedProcess:
    """Headless chromium with a throw-away profile. `--virtual-time-budget` lets the page's fetches and script
    finish before the DOM is dumped or the screenshot taken."""
    binary = chromium_binary()
    assert binary, "chromium is not installed: apt-get install --no-install-recommends chromium (.ci/run does)"
    profile = work / "chromium-profile"
    return subprocess.run(
        [
            binary,
            "--headless",
            "--no-sandbox",  # tests run as root
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            "--virtual-time-budget=15000",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def dump_dom(work: Path, url: str) -> str:
    """The page's DOM after its script ran (headless chromium)."""
    run = chromium(work, "--dump-dom", url)
    assert run.returncode == 0 and "<html" in run.stdout, run.stderr[-3000:]
    return run.stdout


def screenshot(work: Path, url: str, png: Path, size: str = "1400,1000") -> None:
    """The page as a PNG of `size` (width,height) after its script ran (headless chromium)."""
    run = chromium(work, f"--screenshot={png}", f"--window-size={size}", url)
    assert run.returncode == 0 and png.is_file(), run.stderr[-3000:]


UNIT = "rigforge-vllm@dual-turbo.service"  # the vLLM unit the live fleet's rigs run (as the systemd collector names it)
UNIT_STATES = ("activating", "active", "deactivating", "failed", "inactive")  # the node exporter's systemd collector's


class LiveRig:
    """A rig on 127.0.0.1 for the live fleet: the testbed's stand-in nvidia-smi (two RTX 3090s, capped at 230 W)
    under its own simulated root, a fake PCI bus showing both cards, the cap hold's pass and the GPU collector as
    rigforge renders them, the collector's textfile dir served at /metrics (with the vLLM unit's state as Debian's
    node exporter's systemd collector exports it), and the testbed's vLLM stand-in (openai_stub) serving."""

    def __init__(self, work: Path, name: str):
        from test_gpu_hold import Rig
        from test_gpu_metrics import TWO_GPUS, pci_tree

        from rigforge.model.render import render_gpu_metrics

        self.name = name
        self.dir = work / name
        self.dir.mkdir(parents=True)
        self.sim = Rig(self.dir)  # stand-in nvidia-smi, fake journal and systemd, the hold's pass for 230 W caps
        self.sysfs = pci_tree(self.dir, TWO_GPUS)
        self.collector = self.dir / "rigforge-gpu-metrics"
        self.collector.write_text(render_gpu_metrics({0: 230, 1: 230}, "dual-turbo", "vllm/vllm-openai:stand-in"))
        self.textfile = self.dir / "textfile"
        self.textfile.mkdir()
        for gpu in (0, 1):
            self.sim.set_cap(gpu, 230)
        self.unit_active(True)
        self.collect()
        # vLLM in a process of its own, as the unit's container: stopping it closes the scrape's open connection too
        stub = [sys.executable, "-m", "rigforge.testbed.openai_stub", "--ttft-ms", "5", "--dt-ms", "5", "--tokens", "8"]
        self.vllm = subprocess.Popen(stub, stdout=subprocess.PIPE, text=True)
        self.vllm_port = int(self.vllm.stdout.readline().rsplit(":", 1)[1])
        self.node = serve_textfiles(self.textfile)
        self.node_port = self.node.server_address[1]
        self.writer = False  # a writer that keeps setting GPU0 to 250 W against the hold

    def collect(self) -> None:
        """One run of the GPU collector, as its timer runs it."""
        argv = ["sh", str(self.collector), str(self.sim.smi), str(self.textfile), str(self.sysfs), str(self.sim.state)]
        run = subprocess.run(argv, env=self.sim.env, capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr

    def unit_active(self, active: bool) -> None:
        """The vLLM unit's state, as node_systemd_unit_state has it: one 0/1 series per state."""
        now = "active" if active else "inactive"
        series = 'node_systemd_unit_state{{name="{unit}",state="{state}",type="simple"}} {value}'
        lines = [series.format(unit=UNIT, state=s, value=int(s == now)) for s in UNIT_STATES]
        text = "# HELP node_systemd_unit_state Systemd unit\n# TYPE node_systemd_unit_state gauge\n"
        (self.textfile / "systemd.prom").write_text(text + "\n".join(lines) + "\n")

    def stop_vllm(self) -> None:
        """`systemctl stop` of the vLLM unit: the unit inactive, its port closed."""
        self.unit_active(False)
        self.vllm.terminate()
        self.vllm.wait(timeout=20)

    def lose_gpu(self, gpu: int) -> None:
        """The card falls off the bus for nvidia-smi (the stand-in's "lost", as after Xid 79); sysfs still shows it."""
        state = self.sim.sim / "var/lib/rigforge-sim/state.json"
        state.write_text(json.dumps({**json.loads(state.read_text()), "lost": [gpu]}))

    def tick(self, n: int) -> None:
        """Second `n` of the rig's life: a cap writer (when on) sets GPU0 to 250 W every 6 s, the hold's pass runs
        3 s after it (it sets the cap back and counts it), and the collector runs every second."""
        if self.writer and n % 6 == 0:
            self.sim.set_cap(0, 250)
        if self.writer and n % 6 == 3:
            held = self.sim.hold()
            assert held.returncode == 0, held.stderr
        self.collect()

    def close(self) -> None:
        """Stop the rig's vLLM stand-in and its exporter."""
        if self.vllm.poll() is None:
            self.vllm.terminate()
            self.vllm.wait(timeout=20)
        self.vllm.stdout.close()
        self.node.shutdown()
        self.node.server_close()


def serve_textfiles(directory: Path) -> http.server.ThreadingHTTPServer:
    """/metrics: the *.prom files of `directory`, as the node exporter's textfile collector serves them (each file
    read at the scrape; a file the collector is replacing is read whole, the collector renames it into place)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            """/metrics: the files' text; any other path: 404 with the same text."""
            body = "".join(p.read_text() for p in sorted(directory.glob("*.prom"))).encode()
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            """Quiet: no line per scrape."""

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


class LiveFleet:
    """Three live rigs behind the real gateway (Debian's HAProxy, rendered by rigforge/model/gateway.py), scraped every
    second by Debian's Prometheus with the config rigforge.model.monitor renders and the repo's alerting rules with
    every `for:` set to 0s, serving the repo's console pages. A load thread sends a chat completion through the gateway
    every 0.3 s; a tick thread runs each rig's second (collector, cap writer, hold)."""

    def __init__(self, work: Path, names: tuple[str, ...] = ("rig1", "rig2", "rig3")):
        self.work = work
        self.rigs = {name: LiveRig(work, name) for name in names}
        self.stopped = threading.Event()
        self.threads: list[threading.Thread] = []
        self.url = ""

    def start(self, stack: contextlib.ExitStack) -> str:
        """Start the gateway, Prometheus and the threads; the Prometheus URL. Everything stops with `stack`."""
        import dataclasses

        from test_gateway import gw_knobs, rig, running_haproxy

        from rigforge.model import gateway, monitor
        from rigforge.model.knobs.monitor import Monitor

        stack.callback(self.close)
        plans = [rig(name, "dual-turbo", r.vllm_port) for name, r in self.rigs.items()]
        plan, problems = gateway.build("gw", gw_knobs(), plans)
        assert problems == [], problems
        api, metrics = free_port(), free_port()
        plan = dataclasses.replace(plan, bind=f"127.0.0.1:{api}", metrics_bind=f"127.0.0.1:{metrics}")
        gw_dir = self.work / "gw"
        gw_dir.mkdir()
        stack.enter_context(running_haproxy(gw_dir, plan))
        self.gateway_url = f"http://127.0.0.1:{api}"
        targets = {
            "node": tuple((n, f"127.0.0.1:{r.node_port}") for n, r in self.rigs.items()),
            "vllm": tuple((n, f"127.0.0.1:{r.vllm_port}") for n, r in self.rigs.items()),
            "haproxy": (("gw", f"127.0.0.1:{metrics}"),),
        }
        prom = self.work / "prometheus"
        prom.mkdir()
        (prom / "prometheus.yml").write_text(monitor.render_config(targets, Monitor(monitor_scrape_interval_s=1)))
        (prom / "rigforge-alerts.rules.yml").write_text(re.sub(r"(?m)^(\s+for:) \S+$", r"\1 0s", monitor.rules()))
        self.url = stack.enter_context(prometheus(prom, prom / "prometheus.yml"))
        for target in (self.load, self.ticks):
            thread = threading.Thread(target=target, daemon=True)
            thread.start()
            self.threads.append(thread)
        return self.url

    def load(self) -> None:
        """A chat completion through the gateway every 0.3 s until the fleet closes (answers not checked), each a new
        conversation: under prefix affinity (the gateway's default) conversations spread over the rigs."""
        from test_gateway import call

        n = 0
        while not self.stopped.wait(0.3):
            n += 1
            messages = [{"role": "user", "content": f"hi, conversation {n}"}]
            body = {"model": "qwen3.6-27b-autoround", "messages": messages, "max_tokens": 8}
            call(f"{self.gateway_url}/v1/chat/completions", body, key=None)

    def ticks(self) -> None:
        """Every second until the fleet closes, each rig's second (`LiveRig.tick`)."""
        n = 0
        while not self.stopped.wait(1):
            n += 1
            for r in self.rigs.values():
                r.tick(n)

    def firing(self) -> set[tuple[str, str, str]]:
        """(alert, rig or gateway server, gpu) of every alert firing now."""
        with urllib.request.urlopen(f"{self.url}/api/v1/alerts", timeout=10) as r:
            alerts = json.loads(r.read())["data"]["alerts"]
        firing = [a["labels"] for a in alerts if a["state"] == "firing"]
        return {
            (labels["alertname"], labels.get("rig", labels.get("server", "")), labels.get("gpu", ""))
            for labels in firing
        }

    def promql(self, query: str) -> list[dict]:
        """Prometheus's answer to an instant query now."""
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': query})}") as r:
            answer = json.loads(r.read())
        assert answer["status"] == "success", answer
        return answer["data"]["result"]

    def wait(self, what: str, check: Callable[[], object], timeout: float = 60) -> None:
        """Poll `check()` every 0.5 s until it is true; fails naming `what` and the alerts firing."""
        deadline = time.monotonic() + timeout
        while not check():
            assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s; firing: {self.firing()}"
            time.sleep(0.5)

    def close(self) -> None:
        """Stop the threads, then every rig (the gateway and Prometheus stop with the caller's stack)."""
        self.stopped.set()
        for thread in self.threads:
            thread.join(timeout=30)
        for r in self.rigs.values():
            r.close()


@contextlib.contextmanager
def prometheus(storage_dir: Path, config: Path, extra: tuple[str, ...] = ()) -> Iterator[str]:
    """Debian's prometheus on 127.0.0.1:PORT with `config`, its TSDB in storage_dir/data, serving the repo's consoles;
    yields its base URL once ready."""
    port = free_port()
    log_path = storage_dir / "prometheus.log"
    log = log_path.open("w")
    proc = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={config}",
            f"--storage.tsdb.path={storage_dir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            f"--web.console.templates={CONSOLES}",
            f"--web.console.libraries={LIBRARIES}",
            *extra,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "prometheus not ready in 30 s: " + log_path.read_text()
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def main() -> None:
    """Regenerate docs/fleet-page.png and docs/fleet-page-faults.png, as root: `.venv/bin/python
    tests/fleet_page_support.py [DIR]`. One live fleet (LiveFleet) with the page's graphs over 5 minutes: healthy
    after 150 s, then with tests/test_fleet_page_faults.py's three faults, 75 s after they were made."""
    import tempfile

    out = Path(sys.argv[1] if len(sys.argv) > 1 else REPO / "docs").resolve()
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        fleet = LiveFleet(Path(tmp))
        url = fleet.start(stack) + "/consoles/rigforge-fleet.html?range=300"
        time.sleep(150)
        assert not fleet.firing(), fleet.firing()
        screenshot(Path(tmp), url, out / "fleet-page.png", "1400,1900")
        fleet.rigs["rig1"].stop_vllm()
        fleet.rigs["rig2"].lose_gpu(1)
        fleet.rigs["rig3"].writer = True
        time.sleep(75)
        screenshot(Path(tmp), url, out / "fleet-page-faults.png", "1400,1900")
    print(out / "fleet-page.png", out / "fleet-page-faults.png")


if __name__ == "__main__":
    main()
