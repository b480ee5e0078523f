"""docs/architecture.md names every module of rigforge/ and roles/ (a new module without a line there fails), and
the modules that read host data (an AST scan)."""

from __future__ import annotations

import ast
import re
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
