"""The README's knob and variant tables stay in step with the code: every role default and every serving
setting is documented, and every documented key exists."""

import re
from pathlib import Path

from rigforge.model.catalog import load_catalog
from rigforge.model.knobs import docker_engine, gpu_power, monitor, nvidia_driver, serving, site, weights
from rigforge.model.schema import HOST_KEYS, SETTINGS

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
ROLES = (docker_engine, gpu_power, monitor, nvidia_driver, serving, site, weights)  # sources: serving's rigforge_root


def documented_keys() -> set[str]:
    section = README.split("## Knobs", 1)[1].split("\n## ", 1)[0]
    keys = set()
    for row in section.splitlines():
        if row.startswith("| `"):
            keys |= set(re.findall(r"`([a-z0-9_]+)`", row.split("|")[1]))
    return keys


def test_every_role_default_and_setting_is_in_the_knob_table():
    code_keys = {k for role in ROLES for k in role.DEFAULTS}
    code_keys |= set(HOST_KEYS.values())  # each setting under the host-data key it comes from
    assert code_keys - documented_keys() == set()


def test_every_documented_knob_exists():
    code_keys = {k for role in ROLES for k in role.DEFAULTS} | {f"serving_{n}" for n in SETTINGS}
    assert documented_keys() - code_keys == set()


def test_variant_table_matches_the_catalog():
    for v in load_catalog().variants.values():
        row = next(line for line in README.splitlines() if line.startswith(f"| `{v.name}` "))
        fig = v.figures
        assert f"| {v.port} |" in row and f"{fig['narr_tps']} / {fig['code_tps']}" in row


def test_the_readme_names_what_the_test_loops_need_and_how_long_they_take():
    """Issue 32, point 10: the fast loop needs haproxy; commands without .venv/bin/ need the venv activated."""
    tests = README.split("Run the tests", 1)[1].split("\n## ", 1)[0]
    assert "`haproxy`" in tests and "about 2 minutes" in tests
    assert re.search(r"included \(root, about \d+ minutes\)", tests)
    real_rig = README.split("## On a real rig", 1)[1].split("\n## ", 1)[0]
    assert ". .venv/bin/activate" in real_rig.split("1. ", 1)[0]
    first_bare = min(README.find(s) for s in ("`pyinfra inventories", "\npyinfra ", "\nrigforge ") if s in README)
    assert README.index(". .venv/bin/activate") < first_bare  # said before the first command that needs it
