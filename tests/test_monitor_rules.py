"""The fleet's alerting rules (templates/monitor/rigforge-alerts.rules.yml): `promtool check rules` accepts them,
`promtool test rules` passes tests/monitor/rigforge-alerts.test.yml, which has for every alert a case where it fires
and one where it stays silent, and the rules read only what the exporters export.

promtool comes from Debian's `prometheus` package, which .ci/run installs: without it these tests fail, they do not
skip.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import yaml

from rigforge.model.render import render_gpu_metrics

REPO = Path(__file__).resolve().parents[1]
RULES = REPO / "templates/monitor/rigforge-alerts.rules.yml"
TESTS = REPO / "tests/monitor/rigforge-alerts.test.yml"


def promtool() -> str:
    """Asserted, not skipped: a missing promtool fails the test (.ci/run installs it)."""
    found = shutil.which("promtool")
    assert found, "promtool is missing: apt-get install --no-install-recommends prometheus (.ci/run installs it)"
    return found


def rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def test_promtool_checks_the_rules():
    r = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(rules())} rules found" in r.stdout


def test_promtool_rule_tests_pass(tmp_path):
    # run from elsewhere: promtool finds the rule_files from the test file's own dir
    r = subprocess.run(
        [promtool(), "test", "rules", str(TESTS)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_every_alert_has_a_firing_and_a_silent_case():
    cases: dict[str, set[str]] = {}
    for group in yaml.safe_load(TESTS.read_text())["tests"]:
        for case in group.get("alert_rule_test", []):
            cases.setdefault(case["alertname"], set()).add("fires" if case.get("exp_alerts") else "silent")
    alerts = {rule["alert"] for rule in rules()}
    assert alerts == {
        "RigforgeGpuMissing",
        "RigforgeCapNotDeclared",
        "RigforgeCapSetBack",
        "RigforgeVllmUnitDown",
        "RigforgeGatewayBackendDown",
        "RigforgeKvCacheFull",
        "RigforgeThroughputDrop",
        "RigforgeGpuMetricsStale",
        "RigforgeXidErrors",
        "RigforgeVllmMetricsAbsent",
    }
    missing = {a: {"fires", "silent"} - cases.get(a, set()) for a in alerts}
    assert not {a: m for a, m in missing.items() if m}, "alerts without a firing or a silent case"
    assert set(cases) <= alerts, "a test names an alert the rules do not have"


def names(text: str, prefix: str) -> set[str]:
    return set(re.findall(rf"\b{prefix}[a-zA-Z0-9_:]+", text))


def test_the_rules_read_what_the_collector_writes_and_watch_every_vllm_name_they_read():
    exprs = [rule["expr"] for rule in rules()]
    collector = render_gpu_metrics({0: 230}, "v", "i")
    assert names(" ".join(exprs), "rigforge_") <= names(collector, "rigforge_")
    assert names(TESTS.read_text(), "rigforge_") <= names(collector, "rigforge_")
    scoped = r"absent\((vllm:[a-z_]+)\) and on \(\) count\(up\{serving_engine=\"vllm\"\}\) > 0"
    watched = {m[1] for e in exprs if (m := re.fullmatch(scoped, e))}  # only while the fleet has a vLLM rig
    read = names(" ".join(e for e in exprs if not e.startswith("absent(")), "vllm:")
    assert read <= watched, f"vLLM names the rules read but no absent() rule watches: {read - watched}"
    for rule in rules():
        if rule["expr"].startswith("absent("):
            assert rule["labels"]["metric"] in rule["expr"]


def test_every_rule_says_how_bad_and_what_happened():
    for rule in rules():
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
