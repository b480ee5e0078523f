"""The fleet page on a real Prometheus (tests/test_fleet_page.py, benchmarks/fleet_page_screenshot.py).

- `openmetrics`: an hour of the series the page reads, for some rigs, as OpenMetrics text;
- `running_prometheus`: Debian's /usr/bin/prometheus on 127.0.0.1, its storage backfilled with that text by
  `promtool tsdb create-blocks-from openmetrics`, serving the repo's consoles and console libraries;
- `chromium`: headless Debian chromium (`--no-sandbox`: tests run as root) dumping the DOM after the page's
  JavaScript ran, or taking a screenshot.
"""

from __future__ import annotations

import contextlib
import math
import re
import shutil
import socket
import subprocess
import time
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONSOLES = REPO / "templates/monitor/consoles"
LIBRARIES = REPO / "templates/monitor/console_libraries"
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"  # Debian's prometheus (.ci/run installs it)
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
STEP_S = 15  # the Fleet's scrape interval
RIGS = {"rig1": True, "rig2": True, "rig3": False}  # the test's rigs; rig3: its vLLM target down all hour


def chromium_binary() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def openmetrics(rigs: dict[str, bool], end: int, minutes: int = 60, gpus: int = 2) -> str:
    """An hour (to `end`, unix seconds) of scrapes for each rig: its node exporter's `up` and GPU series and, where
    `rigs[name]` is true, its vLLM's `up` and metrics (else vLLM's target is down the whole time: `up` 0, no
    metrics). Deterministic: smooth curves with a phase per rig and GPU."""
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
            series(
                "rigforge_gpu_power_draw_watts",
                "gauge",
                labels,
                lambda i, t, p=phase: 175 + 45 * math.sin(i / 23 + p) + 8 * math.sin(i / 3.1 + p),
            )
            series(
                "rigforge_gpu_temperature_celsius", "gauge", labels, lambda i, t, p=phase: 62 + 9 * math.sin(i / 31 + p)
            )
        if not vllm_up:
            continue
        load = {"model_name": "Qwen/Qwen3-32B-AWQ", "engine": "0", **vllm}

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
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_prometheus(work: Path, rigs: dict[str, bool], end: int | None = None):
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
    port = free_port()
    log = (work / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={config}",
            f"--storage.tsdb.path={storage}",
            f"--web.listen-address=127.0.0.1:{port}",
            f"--web.console.templates={CONSOLES}",
            f"--web.console.libraries={LIBRARIES}",
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
            assert proc.poll() is None, (work / "prometheus.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "prometheus not ready in 30 s: " + (work / "prometheus.log").read_text()
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


class Page(HTMLParser):
    """The dumped DOM, reduced to: rig -> graph -> (state, {series: path d}, {legend text: last value})."""

    def __init__(self, dom: str):
        super().__init__()
        self.body: dict = {}
        self.rigs: dict[str, dict[str, dict]] = {}
        self.rig = self.graph = None
        self.item: list[str] | None = None
        self.feed(dom)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "body":
            self.body = a
        elif tag == "section" and "data-rig" in a:
            self.rig = self.rigs.setdefault(a["data-rig"], {})
        elif tag == "figure" and self.rig is not None:
            self.graph = self.rig.setdefault(a["data-graph"], {"state": a.get("data-state"), "paths": {}, "legend": {}})
        elif tag == "path" and self.graph is not None and "data-series" in a:
            self.graph["paths"][a["data-series"]] = a.get("d", "")
        elif tag == "li" and self.graph is not None:
            self.item = []

    def handle_data(self, data):
        if self.item is not None:
            self.item.append(data)

    def handle_endtag(self, tag):
        if tag == "li" and self.item is not None:
            text = "".join(self.item).strip()
            label, _, value = text.rpartition(" ")
            self.graph["legend"][label] = value
            self.item = None
        elif tag == "figure":
            self.graph = None
        elif tag == "section":
            self.rig = None


def points(d: str) -> int:
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
    run = chromium(work, "--dump-dom", url)
    assert run.returncode == 0 and "<html" in run.stdout, run.stderr[-3000:]
    return run.stdout


def screenshot(work: Path, url: str, png: Path, size: str = "1400,1000") -> None:
    run = chromium(work, f"--screenshot={png}", f"--window-size={size}", url)
    assert run.returncode == 0 and png.is_file(), run.stderr[-3000:]


def main() -> None:
    """Regenerate docs/fleet-page.png: the page over the test's data (rig3's vLLM down all hour), as root:
    `.venv/bin/python tests/fleet_page_support.py [OUT.png]`."""
    import sys
    import tempfile

    out = Path(sys.argv[1] if len(sys.argv) > 1 else REPO / "docs/fleet-page.png").resolve()
    with tempfile.TemporaryDirectory() as tmp, running_prometheus(Path(tmp), RIGS) as url:
        screenshot(Path(tmp), f"{url}/consoles/rigforge-fleet.html", out)
    print(out)


if __name__ == "__main__":
    main()
