"""The knobs of the monitor host (inventory group `monitor`, docs/monitoring.md): defaults (commented) and checks."""

import re
from collections.abc import Mapping
from dataclasses import dataclass

from rigforge.model import schema
from rigforge.model.knobs import Knobs, defaults_of


@dataclass(frozen=True)
class Monitor(Knobs):
    """The monitor host's Prometheus and the rigs' node exporter it scrapes (roles/monitor.py)."""

    # on the monitor: samples older than this are dropped (Prometheus's --storage.tsdb.retention.time)
    monitor_retention_time: str = "15d"
    monitor_retention_size: str = "10GB"  # on the monitor: the disk samples may take (--storage.tsdb.retention.size)
    monitor_scrape_interval_s: int = 15  # on the monitor: how often every target is scraped
    monitor_node_exporter_port: int = 9100  # on a rig: where Debian's prometheus-node-exporter listens
    monitor_url: str | None = None  # on the monitor: where people reach it, as status shows it (None: http://HOST:9090)


DEFAULTS = defaults_of(Monitor)
DURATION = re.compile(r"^[1-9][0-9]*(ms|s|m|h|d|w|y)$")  # Prometheus's durations, one unit
SIZE = re.compile(r"^[1-9][0-9]*(B|KB|MB|GB|TB|PB|EB)$")  # Prometheus's byte sizes


def validate(data: Mapping) -> list[str]:
    problems = schema.integer(data, "monitor_scrape_interval_s", 1, 3600, " of seconds")
    problems += schema.integer(data, "monitor_node_exporter_port", 1, 65535)
    for key, form, example in (("monitor_retention_time", DURATION, "15d"), ("monitor_retention_size", SIZE, "10GB")):
        problems += schema.matches(data, key, form, f"a number with a unit as Prometheus reads it (e.g. {example})")
    return problems + schema.http_url(data, "monitor_url", "people reach the monitor at")
