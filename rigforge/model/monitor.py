"""The monitor's Prometheus (docs/monitoring.md) as data: scrape config from `Fleet.targets`, storage flags, pages."""

import json
from collections.abc import Mapping

import yaml

from rigforge.layout import MONITOR_CONSOLE_LIBRARIES, MONITOR_CONSOLES, MONITOR_RULES
from rigforge.model.knobs.monitor import Monitor
from rigforge.model.render import TEMPLATES

JOBS = {
    "node": "/metrics",
    "vllm": "/metrics",
    "llamacpp": "/metrics",
    "haproxy": "/metrics",
}  # the Fleet's jobs, paths
# a serving job's targets carry `serving_engine` (the vLLM-only alerts are scoped by it); not `engine`, which vLLM's
# own metrics carry (its engine core's index) and a target label of that name would rename to exported_engine
SERVING_ENGINE = {"vllm": "vllm", "llamacpp": "llama.cpp"}
PORT = 9090  # where Debian's prometheus listens: its --web.listen-address default (":9090"); rigforge sets no other
TARGETS_PATH = "/api/v1/targets?state=active"  # Prometheus's HTTP API: the targets it scrapes, each with its health


def render_config(targets: Mapping[str, tuple[tuple[str, str], ...]], knobs: Monitor) -> str:
    """prometheus.yml: a job per kind of target, each labelled `rig` (or `gateway`): its host, and a serving job's
    `serving_engine` (SERVING_ENGINE); MONITOR_RULES' rules."""
    interval = f"{knobs.monitor_scrape_interval_s}s"
    config = {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "rule_files": [MONITOR_RULES.rsplit("/", 1)[1]],  # beside the config: promtool checks them staged together
        "scrape_configs": [
            {
                "job_name": job,
                "metrics_path": JOBS[job],
                "static_configs": [
                    {"targets": [address], "labels": target_labels(job, host)} for host, address in targets.get(job, ())
                ],
            }
            for job in JOBS
        ],
    }
    header = "# rigforge: the monitor's Prometheus (roles/monitor.py), made from the fleet; rewritten by every run\n"
    return header + yaml.safe_dump(config, sort_keys=False)


def target_labels(job: str, host: str) -> dict[str, str]:
    """The labels of `host`'s target in `job`: `gateway` or `rig` (its host), and a serving job's engine."""
    labels = {"gateway" if job == "haproxy" else "rig": host}
    if job in SERVING_ENGINE:
        labels["serving_engine"] = SERVING_ENGINE[job]
    return labels


def args(knobs: Monitor) -> str:
    """Prometheus's storage flags for /etc/default/prometheus (ARGS): retention by time and by size."""
    retention = {"time": knobs.monitor_retention_time, "size": knobs.monitor_retention_size}
    return " ".join(f"--storage.tsdb.retention.{by}={value}" for by, value in retention.items())


def rules() -> str:
    """The alerting rules (templates/monitor/rigforge-alerts.rules.yml), installed at MONITOR_RULES."""
    return (TEMPLATES / "monitor" / MONITOR_RULES.rsplit("/", 1)[1]).read_text()


def consoles() -> dict[str, dict[str, str]]:
    """{dir Debian's Prometheus reads them from: {name: text}} of templates/monitor/consoles, console_libraries."""
    return {
        dest: {p.name: p.read_text() for p in sorted((TEMPLATES / "monitor" / src).iterdir()) if p.is_file()}
        for src, dest in (("consoles", MONITOR_CONSOLES), ("console_libraries", MONITOR_CONSOLE_LIBRARIES))
    }


def active_targets(code: int, body: str) -> list[dict] | None:
    """The `activeTargets` (labels, health, lastError) Prometheus answered TARGETS_PATH with, else None."""
    try:
        answer = json.loads(body) if code == 200 else None
        return list(answer["data"]["activeTargets"]) if answer["status"] == "success" else None
    except (ValueError, KeyError, TypeError):
        return None
