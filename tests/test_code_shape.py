"""What the code keeps to (issue 48), checked rather than claimed: black's layout everywhere (no `# fmt: skip` in the
product code; in tests and benchmarks only on a table of constants laid out by hand), and every function of the
product code annotated (ruff's ANN rules, with no exemption left for a file of rigforge/, roles/ or deploy/)."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("rigforge", "roles", "deploy")
FORMATTED = ("tests", "benchmarks", "inventories")  # tests/fixtures: vendored files, verbatim


def product_files() -> list[Path]:
    return [path for top in PRODUCT for path in sorted((REPO / top).rglob("*.py"))]


def is_table(node: ast.expr) -> bool:
    """A literal of constants only (a list, tuple, dict or set, nested or not): data laid out as a table."""
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return all(is_table(item) for item in node.elts)
    if isinstance(node, ast.Dict):
        return all(key is not None and is_table(key) for key in node.keys) and all(map(is_table, node.values))
    return False


def opted_out(path: Path) -> list[tuple[int, bool]]:
    """Each statement of `path` that ends in `# fmt: skip`: (its first line, whether it assigns a literal table)."""
    lines = path.read_text().splitlines()
    skipped = {number for number, line in enumerate(lines, start=1) if line.rstrip().endswith("# fmt: skip")}
    found = []
    for node in ast.walk(ast.parse("\n".join(lines))):
        if isinstance(node, ast.stmt) and node.end_lineno in skipped:
            value = node.value if isinstance(node, ast.Assign | ast.AnnAssign) else None
            table = isinstance(value, ast.List | ast.Tuple | ast.Dict) and is_table(value)
            found.append((node.lineno, table))
    return found


def test_the_product_code_never_opts_out_of_the_formatter():
    skipped = [f"{path.relative_to(REPO)}:{line}" for path in product_files() for line, _ in opted_out(path)]
    assert skipped == [], skipped


def test_tests_and_benchmarks_opt_out_of_the_formatter_only_for_a_table():
    """A table of constants laid out by hand (a flag beside its values) may keep its layout; a statement packed
    onto fewer lines may not."""
    files = [path for top in FORMATTED for path in sorted((REPO / top).rglob("*.py")) if "fixtures" not in path.parts]
    packed = [f"{path.relative_to(REPO)}:{line}" for path in files for line, table in opted_out(path) if not table]
    assert packed == [], packed


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
