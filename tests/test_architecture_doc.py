"""docs/architecture.md names every module of rigforge/ and roles/ (a new module without a line there fails)."""

from __future__ import annotations

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
