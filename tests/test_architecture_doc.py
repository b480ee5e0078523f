"""docs/architecture.md names every module of rigforge/ and roles/ (a new module without a line there fails), the
modules that read host data (an AST scan), and the variant's route (a traced `--dry` deploy)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_every_module_is_named_in_the_architecture_doc():
    doc = (REPO / "docs" / "architecture.md").read_text()
    modules = [
        p.relative_to(REPO).as_posix()
        for top in ("rigforge", "roles")
        for p in sorted((REPO / top).rglob("*.py"))
        if p.name != "__init__.py" or p.parent.name == "testbed"
    ]
    missing = [m for m in modules if f"`{m}`" not in doc]
    assert not missing, f"docs/architecture.md does not name: {missing}"
    named = {line.split("`")[1] for line in doc.splitlines() if line.startswith("| `")}
    gone = sorted(n for n in named if not (REPO / n).exists())
    assert not gone, f"docs/architecture.md names modules that do not exist: {gone}"


HOST_NAMES = {"host", "h"}  # what the code names a pyinfra host (a plan is `plan`, a rig context `ctx`)


def host_data_readers() -> set[str]:
    """The modules of rigforge/ (not the testbed), roles/ and deploy/ that read `host.data` or `h.data`."""
    readers = set()
    for top in ("rigforge", "roles", "deploy"):
        for path in sorted((REPO / top).rglob("*.py")):
            if "testbed" in path.parts:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                reads = isinstance(node, ast.Attribute) and node.attr == "data"
                if reads and isinstance(node.value, ast.Name) and node.value.id in HOST_NAMES:
                    readers.add(path.relative_to(REPO).as_posix())
    return readers


def test_the_host_data_readers_the_doc_names_are_the_ones_the_code_has():
    """Issue 48: "the only reader of host data" is checked, not claimed: the doc's list is the AST scan's."""
    doc = (REPO / "docs" / "architecture.md").read_text()
    line = doc[doc.index("Host data readers:") :].split("\n\n")[0]
    named = set(re.findall(r"`((?:rigforge|roles|deploy)/[\w/]+\.py)`", line))
    found = host_data_readers()
    assert named == found, f"the doc names {sorted(named - found)} that read none; it misses {sorted(found - named)}"
    assert not any(module.startswith(("roles/", "deploy/")) for module in found), found


def route_in_doc() -> list[str]:
    """The modules the route paragraph of docs/architecture.md names in backticks, in order."""
    doc = (REPO / "docs" / "architecture.md").read_text()
    paragraph = doc[doc.index("The variant's route") : doc.index("A recipe-repo slug takes")]
    return re.findall(r"`((?:deploy|roles|rigforge)/[\w/]+\.py)`", paragraph)


def test_the_route_paragraph_is_the_traced_route_of_a_dry_deploy(tmp_path):
    """Issue 48: `pyinfra --dry deploy/dual_turbo.py` on a @fake rig, traced by tests/route_trace.py: the modules
    called with the variant (name, object or rendered compose file), in the order first entered, are the ones the
    paragraph names, and none is entered twice (its calls with the variant are one run, not split by another
    module's)."""
    from test_plan import lock_file
    from test_roles_host_ops import rig

    data = rig(hf_endpoint="http://127.0.0.1:9", rigforge_lock=lock_file(tmp_path))  # no hub: a closed port
    inventory = tmp_path / "inventory.py"
    inventory.write_text(f"rigs = [('@fake/rig1', {data!r})]\n")
    out = tmp_path / "route.txt"
    env = {**os.environ, "RIGFORGE_ROUTE_OUT": str(out), "HF_TOKEN": "", "RIGFORGE_HF_TOKEN": ""}
    trace = REPO / "tests" / "route_trace.py"
    argv = [sys.executable, str(trace), str(inventory), "deploy/dual_turbo.py", "--dry", "-y"]
    res = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    calls = [line.split(":")[0] for line in out.read_text().splitlines()]
    entered = [module for i, module in enumerate(calls) if i == 0 or calls[i - 1] != module]
    assert len(entered) == len(set(entered)), f"a module entered twice: {entered}"
    assert entered == route_in_doc(), f"the traced route: {entered}"
