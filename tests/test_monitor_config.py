"""The monitor's Prometheus config (rigforge/model/monitor.py): its targets come from the Fleet (every rig's node
exporter and vLLM, the gateway's HAProxy exporter), and the real `promtool check config` accepts it, with the
alerting rules it names; the retention knobs are checked."""

from __future__ import annotations

import shutil
import subprocess

import yaml
from pyinfra.api import Inventory
from support import REPO

from rigforge.model import fleet, monitor
from rigforge.model.fleet import host_data
from rigforge.model.knobs.monitor import Monitor, validate

PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"  # Debian's prometheus (.ci/run installs it)


def fleet_of_two():
    rig = {"rigforge_variant": "dual"}
    inv = Inventory(
        (["rig1", "rig2", "gw"], {}),
        rigs=(["rig1", "rig2"], {}),
        rig1=(["rig1"], {**rig, "gateway_address": "10.77.0.2"}),
        rig2=(["rig2"], {**rig, "serving_port": 8011, "monitor_node_exporter_port": 9200}),
        gateway=(["gw"], {"gateway_metrics_port": 8405}),
        monitor=(["gw"], {}),
    )
    return inv, fleet.build(inv, deployable=False, gpus=2)


def test_the_fleet_holds_the_monitors_targets_and_a_monitor_host_is_not_a_rig():
    inv, fl = fleet_of_two()
    assert [h.name for h in inv if fleet.is_rig(h)] == ["rig1", "rig2"]
    assert fl.roles["gw"] == {"gateway", "monitor"}
    port = fl.plans["rig1"].port
    assert dict(fl.targets) == {
        "node": (("rig1", "10.77.0.2:9100"), ("rig2", "rig2:9200")),
        "vllm": (("rig1", f"10.77.0.2:{port}"), ("rig2", "rig2:8011")),
        "llamacpp": (),  # no llama.cpp rig
        "haproxy": (("gw", "127.0.0.1:8405"),),  # the monitor scrapes its own host's HAProxy on its loopback
    }
    # a gateway on another host: at its bind address, else its name
    elsewhere = fleet.targets(
        [],
        {
            "gw": {"gateway_metrics_port": 8405},
            "gw2": {"gateway_metrics_port": 9405, "gateway_bind_address": "10.0.0.9"},
        },
    )
    assert elsewhere["haproxy"] == (("gw", "gw:8405"), ("gw2", "10.0.0.9:9405"))


def test_the_rendered_config_passes_promtool_check_config(tmp_path):
    inv, fl = fleet_of_two()
    text = monitor.render_config(fl.targets, Monitor.of(host_data(inv.get_host("gw").data)))
    config = yaml.safe_load(text)
    jobs = {c["job_name"]: [(s["labels"], s["targets"]) for s in c["static_configs"]] for c in config["scrape_configs"]}
    assert jobs["node"] == [({"rig": "rig1"}, ["10.77.0.2:9100"]), ({"rig": "rig2"}, ["rig2:9200"])]
    assert jobs["haproxy"] == [({"gateway": "gw"}, ["127.0.0.1:8405"])]
    assert config["global"]["scrape_interval"] == "15s" and config["rule_files"] == ["rigforge-alerts.rules.yml"]
    assert monitor.rules() == (REPO / "templates/monitor/rigforge-alerts.rules.yml").read_text()
    (tmp_path / "rigforge-alerts.rules.yml").write_text(monitor.rules())  # beside the config, as on the monitor
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(text)
    check = subprocess.run([PROMTOOL, "check", "config", str(cfg)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "SUCCESS: 1 rule files found" in check.stdout + check.stderr
    cfg.write_text(text.replace("scrape_interval", "scrape_intervall", 1))
    assert subprocess.run([PROMTOOL, "check", "config", str(cfg)], capture_output=True).returncode != 0


def test_retention_knobs_are_checked_and_become_prometheus_flags():
    data = host_data({})
    assert validate(data) == []
    assert monitor.args(Monitor.of(data)) == "--storage.tsdb.retention.time=15d --storage.tsdb.retention.size=10GB"
    bad = validate({**data, "monitor_retention_time": "15 days", "monitor_retention_size": 10})
    assert [p.split(" must")[0] for p in bad] == ["monitor_retention_time", "monitor_retention_size"]
    assert validate({**data, "monitor_url": "http://127.0.0.1:19090"}) == []
    assert validate({**data, "monitor_url": "gw:9090"}) == [
        "monitor_url must be an http(s) URL people reach the monitor at, got 'gw:9090'"
    ]
