"""What the code keeps to (issue 48), checked rather than claimed: black's layout everywhere, tests and benchmarks
included (no `# fmt: skip`: none was an aligned table), and every function of the product code annotated (ruff's
ANN rules, with no exemption left for a file of rigforge/, roles/ or deploy/)."""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("rigforge", "roles", "deploy")
FORMATTED = (*PRODUCT, "tests", "benchmarks", "inventories")  # tests/fixtures: vendored files, verbatim


def product_files() -> list[Path]:
    return [path for top in PRODUCT for path in sorted((REPO / top).rglob("*.py"))]


def test_no_line_of_the_code_opts_out_of_the_formatter():
    files = [path for top in FORMATTED for path in sorted((REPO / top).rglob("*.py")) if "fixtures" not in path.parts]
    skipped = [
        f"{path.relative_to(REPO)}:{number}"
        for path in files
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if line.rstrip().endswith("# fmt: skip")
    ]
    assert skipped == [], skipped


def test_ruff_checks_every_product_file_for_annotations():
    lint = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["ruff"]["lint"]
    assert "ANN" in lint["select"], lint["select"]
    exempt = [
        pattern
        for pattern, rules in lint.get("per-file-ignores", {}).items()
        if "ANN" in rules and pattern.startswith(PRODUCT)
    ]
    assert exempt == [], exempt


def test_every_path_a_module_names_in_the_checkout_exists():
    """A module-level Path into the checkout (a template dir, a rig-side script, the deploy entry the images load
    runs) points at something that is there: moving a module must not leave one pointing into its old place (the
    folder move left roles/operations/images.py uploading rigforge/cli/remote/load_images.sh)."""
    import importlib
    import pkgutil

    import rigforge
    import roles

    names = [
        info.name
        for package in (rigforge, roles)
        for info in pkgutil.walk_packages(package.__path__, f"{package.__name__}.")
        if not info.name.startswith("rigforge.testbed") and not info.name.endswith(".__main__")  # that one runs
    ]
    checked, missing = 0, []
    for name in names:
        module = importlib.import_module(name)
        for attr, value in vars(module).items():
            if isinstance(value, Path) and value.is_absolute() and value.is_relative_to(REPO):
                checked += 1
                if not value.exists():
                    missing.append(f"{name}.{attr} = {value}")
    assert checked >= 6, checked  # the templates, the catalog, the two rig-side scripts, the images entry, the repo
    assert not missing, missing
