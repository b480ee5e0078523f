"""The fleet page (docs/monitoring.md, "The fleet page"): templates/monitor/consoles/rigforge-fleet.html with its
library, served by Debian's real prometheus over an hour of backfilled series, loaded in headless Debian chromium.
After the page's JavaScript ran, every rig of the data has its section and every graph of it its series drawn;
a rig whose vLLM was down all hour shows its GPU graphs and empty vLLM graphs. And roles/monitor.py installs the
page and the library where Debian's prometheus reads them.

No skip: chromium and prometheus are Debian packages .ci/run installs; without them the test fails and says so.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest
from fleet_page_support import (
    CONSOLES,
    HIT_RATES,
    LIBRARIES,
    PROMETHEUS,
    RETRIES,
    RIGS,
    Page,
    chromium_binary,
    dump_dom,
    points,
    running_prometheus,
)

from rigforge.layout import MONITOR_CONSOLE_LIBRARIES, MONITOR_CONSOLES
from rigforge.model import monitor
from rigforge.model.render import render_gpu_metrics

GRAPHS = {  # graph -> the series drawn for a rig with 2 GPUs and vLLM up
    "power": {"GPU 0 draw", "GPU 1 draw", "GPU 0 limit", "GPU 1 limit", "GPU 0 cap", "GPU 1 cap"},
    "temperature": {"GPU 0", "GPU 1"},
    "tps": {"generation", "prompt"},
    "queue": {"running", "waiting"},
    "kv": {"KV cache"},
    "gateway": {"requests", "retries"},
    "prefix": {"hit rate"},
}
VLLM_GRAPHS = ("tps", "queue", "kv", "prefix")


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> Page:
    assert chromium_binary(), "chromium is not installed: apt-get install --no-install-recommends chromium"
    assert os.access(PROMETHEUS, os.X_OK), f"{PROMETHEUS} missing: apt-get install prometheus"
    work = tmp_path_factory.mktemp("fleet-page")
    with running_prometheus(work, RIGS) as url:
        return Page(dump_dom(work, f"{url}/consoles/rigforge-fleet.html"))


def test_every_rig_in_the_data_has_its_section_and_no_other(page):
    assert page.body.get("data-rigforge") == "done", "the page's script did not finish"
    assert list(page.rigs) == ["rig1", "rig2", "rig3"]  # found in the data, sorted; no hand list


@pytest.mark.parametrize("rig", ["rig1", "rig2"])
def test_every_graph_of_a_serving_rig_draws_every_series_over_the_hour(page, rig):
    graphs = page.rigs[rig]
    assert set(graphs) == set(GRAPHS)
    for name, expected in GRAPHS.items():
        graph = graphs[name]
        assert graph["state"] == "drawn", (rig, name, graph["state"])
        assert set(graph["paths"]) == expected, (rig, name)
        for series, d in graph["paths"].items():
            # an hour at the 15 s step is 241 points; rates need 2 samples
            assert points(d) >= 200, (rig, name, series, d[:80])
            assert d.startswith("M"), (rig, name, series)
        assert set(graph["legend"]) == expected
    assert {graphs["power"]["legend"][f"GPU {g} cap"] for g in (0, 1)} == {"230"}  # the declared cap, as exported
    assert {graphs["power"]["legend"][f"GPU {g} limit"] for g in (0, 1)} == {"230"}  # the limit in force
    assert float(graphs["prefix"]["legend"]["hit rate"]) == pytest.approx(100 * HIT_RATES[rig])
    assert all(0 < float(v) <= 100 for v in graphs["kv"]["legend"].values())  # a percentage


def test_a_rig_whose_vllm_was_down_draws_its_gpus_and_empty_vllm_graphs(page):
    graphs = page.rigs["rig3"]
    for name in ("power", "temperature"):
        assert graphs[name]["state"] == "drawn" and set(graphs[name]["paths"]) == GRAPHS[name]
    for name in VLLM_GRAPHS:
        assert graphs[name]["state"] == "empty", name
        assert graphs[name]["paths"] == {} and graphs[name]["legend"] == {}, name
    assert set(graphs["gateway"]["paths"]) == {"retries"}  # no request answered: DOWN at the gateway all hour


def test_the_tables_say_each_rigs_gpus_and_gateway_state_now(page):
    """Over the hour's data: every GPU listed at 230 W against its 230 W cap, never set back; the gateway's state,
    requests, queue and retries per rig; the prefix cache hit rate where vLLM serves, "no data" where it does not."""
    assert page.alerts == []  # no rules loaded: nothing fires
    for rig in ("rig1", "rig2", "rig3"):
        assert page.gpus[rig] == {
            g: ("listed", f"GPU {g} listed 230 W 230 W 0 in the last hour, 0 in all") for g in ("0", "1")
        }, page.gpus[rig]
    gateway = page.gateway
    assert [gateway[rig]["state"] for rig in ("rig1", "rig2", "rig3")] == ["UP", "UP", "DOWN"]
    # 2 and 3 requests/s in the data; a page loaded later than the data's end sees part of the 2 min window
    rps = {rig: float(gateway[rig]["rps"]) for rig in ("rig1", "rig2")}
    assert 1 <= rps["rig1"] <= 2 and rps["rig2"] / rps["rig1"] == pytest.approx(1.5, rel=0.02), rps
    assert gateway["rig3"]["rps"] == "no data"  # no answer counted: not a made-up 0
    assert {gateway[rig]["queue"] for rig in gateway} == {"0"}
    assert [gateway[rig]["retries"] for rig in ("rig1", "rig2", "rig3")] == ["0", str(RETRIES["rig2"]), "0"], gateway
    assert [gateway[rig]["prefix"] for rig in ("rig1", "rig2", "rig3")] == ["62%", "35%", "no data"], gateway


def test_with_no_rig_in_the_data_the_page_says_so(tmp_path):
    with running_prometheus(tmp_path, {}) as url:
        dom = dump_dom(tmp_path, f"{url}/consoles/rigforge-fleet.html")
    page = Page(dom)
    assert page.body.get("data-rigforge") == "done" and page.rigs == {}
    assert "No rig was scraped in the last hour" in dom


def test_the_monitor_role_installs_the_page_and_its_library_where_debians_prometheus_reads_them():
    from test_roles_host_ops import converge, executed, rig, uploads

    from rigforge.model.fleet import host_data
    from rigforge.model.knobs.monitor import Monitor
    from roles import monitor as role

    targets = {"node": (("rig1", "rig1:9100"),), "vllm": (("rig1", "rig1:8010"),), "haproxy": (("gw", "gw:8405"),)}
    state = converge({"m": rig()}, role.server, targets, Monitor.of(host_data({})), False)
    files = uploads(state, "m")
    pages = monitor.consoles()
    assert pages == {
        MONITOR_CONSOLES: {"rigforge-fleet.html": (CONSOLES / "rigforge-fleet.html").read_text()},
        MONITOR_CONSOLE_LIBRARIES: {"rigforge.lib": (LIBRARIES / "rigforge.lib").read_text()},
    }
    out = subprocess.run([PROMETHEUS, "--help"], capture_output=True, text=True)
    flags = out.stdout + out.stderr
    assert f'--web.console.templates="{MONITOR_CONSOLES}"' in flags  # the package's defaults; its unit adds none
    assert f'--web.console.libraries="{MONITOR_CONSOLE_LIBRARIES}"' in flags
    for dest, named in pages.items():
        for name, text in named.items():
            assert files[f"{dest}/.staging/{name}"] == text.encode()  # staged, then renamed into place
            assert any(f"mv -f {dest}/.staging/{name} {dest}/{name}" in c for c in executed(state, "m"))


def test_the_page_reads_what_the_collector_writes_and_vllm_names_an_absent_rule_watches():
    """The page's graphs and its library's tables read only GPU names the collector writes; every vLLM name they
    read is watched by an absent() rule, but the prefix cache's two, which the page shows as "no data" when absent
    (tests/test_fleet_page_faults.py loads it over a vLLM stand-in that may not export them)."""
    text = (CONSOLES / "rigforge-fleet.html").read_text() + (LIBRARIES / "rigforge.lib").read_text()
    read = set(re.findall(r"\b(rigforge_[a-z_]+|vllm:[a-z_]+)", text))
    gpu = {n for n in read if n.startswith("rigforge_gpu_")}  # not the library's templates (rigforge_gpus, ...)
    vllm = {n for n in read if n.startswith("vllm:")}
    assert gpu == {
        "rigforge_gpu_power_draw_watts",
        "rigforge_gpu_power_limit_watts",
        "rigforge_gpu_declared_cap_watts",
        "rigforge_gpu_temperature_celsius",
        "rigforge_gpu_present",
        "rigforge_gpu_cap_setbacks_total",
    }, gpu
    assert gpu <= set(re.findall(r"rigforge_[a-z_]+", render_gpu_metrics({0: 230}, "v", "i")))
    rules = (CONSOLES.parent / "rigforge-alerts.rules.yml").read_text()
    prefix = {"vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"}
    assert len(vllm) == 7 and prefix <= vllm, vllm  # tokens (2), requests (2), KV cache, prefix cache (2)
    assert vllm - prefix <= set(re.findall(r"absent\((vllm:[a-z_]+)\)", rules))  # a renamed name fires an alert
